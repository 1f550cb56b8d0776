"""What ``arborl envs validate`` and ``arborl envs perturb`` do (cli.py parses, this runs)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborl.envs.base import EnvError, Runtime
from arborl.tasks.code_repair.catalog import materialise, suite_root
from arborl.tasks.code_repair.store import RepairTask
from arborl.tasks.code_repair.validate import ValidationCache, validate_tasks

if TYPE_CHECKING:
    from rich.console import Console

    from arborl.config import Config, CodeRepairConfig

VALIDATING_SUITES = ("code_repair",)


def suite_tasks(cr: "CodeRepairConfig", *, variants: bool) -> tuple[list[RepairTask], Path]:
    root = suite_root(cr)
    return materialise(root, cr.seed, cr.per_template, variants=variants), root


def _select(tasks: list[RepairTask], tier: str, which: str, limit: int, split: str = "all") -> list[RepairTask]:
    out = [t for t in tasks if tier in ("all", t.tier) and split in ("all", t.split)]
    if which == "base":
        out = [t for t in out if not t.meta.get("perturbation")]
    elif which == "variants":
        out = [t for t in out if t.meta.get("perturbation")]
    if limit:
        step = max(1, len(out) // limit)  # spread over templates and tiers, not the first ones only
        out = out[::step][:limit]
    return out


def validate_suite(
    cfg: "Config", suite: str, *, tier: str, k: int, jobs: int, which: str, limit: int, console: "Console",
    runtime: Runtime | None = None, split: str = "all",
) -> dict[str, Any]:
    """Validate the suite's tasks (``which``: base, variants or all; ``split``: train, eval or all) and return
    the counts and the dropped."""
    if suite not in VALIDATING_SUITES:
        raise EnvError(f"suite {suite!r} has no validation: `arborl envs validate` knows {', '.join(VALIDATING_SUITES)}")
    if tier not in ("easy", "medium", "hard", "all"):
        raise EnvError(f"--tier must be easy, medium, hard or all, got {tier!r}")
    if split not in ("train", "eval", "all"):
        raise EnvError(f"--split must be train, eval or all, got {split!r}")
    cr = cfg.rollout.code_repair
    tasks, root = suite_tasks(cr, variants=which != "base")
    chosen = _select(tasks, tier, which, limit, split)
    if runtime is None:
        from arborl.envs import make_runtime

        runtime = make_runtime(cfg.rollout.envs)
    console.print(f"validating {len(chosen)} {which} tasks of {suite} (tier {tier}, k={k}) in {runtime.name}; cache {root}")
    t0 = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.perf_counter() - last[0] > 5 or done == total:
            last[0] = time.perf_counter()
            console.print(f"  {done}/{total}")

    report = asyncio.run(validate_tasks(runtime, chosen, k=k, timeout_s=cr.test_timeout_s, jobs=jobs,
                                        cache=ValidationCache(root), progress=progress))
    out: dict[str, Any] = {"suite": suite, "tier": tier, "which": which, "split": split, "k": k, "tasks": len(chosen),
                           **report.counts(), "seconds": round(time.perf_counter() - t0, 1),
                           "dropped": {s: ids for s, ids in report.dropped().items() if ids}}
    by_kind = Counter((t.meta.get("perturbation") or "base", report.results[t.id].status) for t in chosen)
    out["by_perturbation"] = {kind: {s: n for (k2, s), n in by_kind.items() if k2 == kind}
                              for kind in sorted({k2 for k2, _ in by_kind})}
    return out


def perturb_suite(cfg: "Config", console: "Console") -> dict[str, Any]:
    """Materialise the variants of every task; counts per perturbation kind."""
    tasks, root = suite_tasks(cfg.rollout.code_repair, variants=True)
    kinds = Counter(t.meta.get("perturbation") or "base" for t in tasks)
    console.print(f"{len(tasks)} tasks in {root}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    return {"root": str(root), "tasks": len(tasks), **{f"tasks_{k}": n for k, n in sorted(kinds.items())}}
