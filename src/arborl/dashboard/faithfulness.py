"""The token-faithfulness audit of a run (``arborl audit``, ``arborl/audit.py``) as the dashboard's audit
page shows it: the counts and the first drifted calls, their differing tokens decoded. The audit loads
the run's tokenizer and re-renders every recorded conversation of the data pool, so it runs when the
page asks for it, once per state of the data pool: the answer is kept per run directory, examples
shown and the data pool's files' (main file and write-ahead log) modification times and sizes, and
computed again when a running job has written since."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from arborl.audit import audit_run, decoded_examples

def datapool_stamp(datapool: Path) -> tuple[tuple[int, int] | None, ...]:
    """What changes when a job writes to the data pool: its files' mtimes and sizes (SQLite in WAL mode
    writes the -wal file first; a checkpoint moves the pages into the main file)."""
    out = []
    for suffix in ("", "-wal"):
        f = datapool.with_name(datapool.name + suffix)
        try:
            st = f.stat()
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


class AuditCache:
    """``audit(run_dir, datapool)``: ``{**report.summary(), "examples": decoded_examples(...)}``, computed again only
    when the data pool changed; arborl.show.ShowError (an ArborlError) for a run without a data pool or
    a tokenizer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[tuple[Path, int], tuple[Any, dict[str, Any]]] = {}

    def audit(self, run_dir: Path, datapool: Path, examples: int = 5) -> dict[str, Any]:
        """``datapool``: the run's data pool file (its ``datapool.filename``), watched for changes."""
        key = (run_dir, examples)
        with self._lock:  # one audit at a time: each loads a tokenizer and reads a whole data pool
            stamp = datapool_stamp(datapool)
            hit = self._done.get(key)
            if hit is not None and hit[0] == stamp:
                return hit[1]
            report, tokenizer = audit_run(run_dir, examples=examples)
            out = {**report.summary(), "examples": decoded_examples(report, tokenizer)}
            self._done[key] = (stamp, out)
            return out
