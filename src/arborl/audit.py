"""``arborl audit RUN_DIR``: the token-faithfulness audit of a run (``gateway/audit.py``) over its data
pool, with the run's tokenizer, chat template and ``gateway.tool_prompt``; prints the counts and the
first drifted calls (their differing tokens decoded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arborl.datapool import DataPool
from arborl.gateway.audit import AuditReport, audit_episodes
from arborl.gateway.render import ChatRenderer
from arborl.run_config import run_config
from arborl.show import ShowError, _tokenizer


def audit_run(run_dir: str | Path, *, examples: int = 5) -> tuple[AuditReport, Any]:
    """The run's audit report and the tokenizer it used (to decode the examples)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ShowError(f"{run_dir} is not a directory: name a run directory, runs/NAME")
    cfg = run_config(run_dir)
    db = run_dir / cfg.datapool.filename
    if not db.is_file():
        raise ShowError(f"{run_dir} has no {cfg.datapool.filename}: the run recorded nothing yet")
    tokenizer = _tokenizer(run_dir)
    if tokenizer is None:
        raise ShowError(f"{run_dir}: the run's model has no tokenizer, so its calls were token-in: nothing to re-render")
    renderer = ChatRenderer(tokenizer, cfg.gateway.tool_prompt)
    with DataPool(db) as pool:
        episodes = (pool.get_episode(e.episode_id) for e in pool.episodes())
        return audit_episodes(renderer, episodes, examples=examples), tokenizer


def decoded_examples(report: AuditReport, tokenizer: Any) -> list[dict[str, Any]]:
    """The report's examples with their differing tokens as text."""
    out = []
    for e in report.examples:
        out.append({"call_id": e.call_id, "episode_id": e.episode_id, "position": e.position, "stitched": e.stitched,
                    "unfaithful": e.unfaithful, "engine": tokenizer.decode(e.engine_ids),
                    "rerender": tokenizer.decode(e.rerender_ids)})
    return out
