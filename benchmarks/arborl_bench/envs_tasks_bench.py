"""The code-repair suite's figures for ``arborl bench envs``: E3 validation of the suite and of its
perturbed variants (E5), in the bubblewrap sandbox, in a fresh suite directory (no cached verdicts).

``code_repair_section(quick, console)`` returns the figures; ``benchmarks/arborl_bench/envs_bench.py`` calls it (and
``run`` runs it alone). Quick: one base task per template (25, the tiers in turn) with k=2, and the variants of two of them
(a medium and a hard task: 10, two of each kind) with k=2. Full: every base task (400) with k=3, and one
variant of each kind per template (up to 125) with k=3.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from arborl.config import EnvsConfig
from arborl.envs import make_runtime
from arborl.tasks.code_repair import TIERS, load_task, materialise, validate_tasks, variants, write_task
from arborl.tasks.code_repair.store import RepairTask

FIGURES = ("validated_tasks", "dropped_gold_fails", "dropped_noop_passes", "dropped_flaky", "infra_errors")


def _pick(tasks: list[RepairTask], key, per: int) -> list[RepairTask]:
    seen: dict[Any, int] = {}
    out = []
    for t in tasks:
        k = key(t)
        if seen.get(k, 0) < per:
            seen[k] = seen.get(k, 0) + 1
            out.append(t)
    return out


def one_per_template(tasks: list[RepairTask]) -> list[RepairTask]:
    """A task of every template, the tiers in turn (template i gets tier i mod 3)."""
    templates = sorted({t.meta["template"] for t in tasks})
    return [next(t for t in tasks if t.meta["template"] == name and t.tier == TIERS[i % len(TIERS)])
            for i, name in enumerate(templates)]


def code_repair_section(quick: bool, console) -> dict[str, Any]:  # noqa: ANN001 - a rich Console
    k = 2 if quick else 3
    with tempfile.TemporaryDirectory(prefix="arborl-cr-bench-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        tasks = materialise(root / "suite", 0, 16, variants=not quick)
        gen_s = time.perf_counter() - t0
        base = [t for t in tasks if not t.meta.get("perturbation")]
        if quick:
            base = one_per_template(base)
            origins = [next(t for t in base if t.tier == tier) for tier in ("medium", "hard")]
            var = [load_task(write_task(v, root / "suite" / "tasks", split=o.split))
                   for o in origins for v in variants(o.files(), 0)]
        else:
            var = _pick([t for t in tasks if t.meta.get("perturbation")],
                        lambda t: (t.meta["template"], t.meta["perturbation"]), 1)
        runtime = make_runtime(EnvsConfig(root_dir=str(root / "envs")))
        console.print(f"code_repair: validating {len(base)} base tasks and {len(var)} variants, k={k}, in {runtime.name} ...")
        t0 = time.perf_counter()
        rb = asyncio.run(validate_tasks(runtime, base, k=k, jobs=2))
        base_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        rv = asyncio.run(validate_tasks(runtime, var, k=k, jobs=2))
        var_s = time.perf_counter() - t0
    cb, cv = rb.counts(), rv.counts()
    table = Table(title=f"code_repair validation (k={k}, {runtime.name}; {len(tasks)} tasks generated in {gen_s:.1f} s)")
    table.add_column("figure")
    table.add_column("suite", justify="right")
    table.add_column("variants", justify="right")
    for f in FIGURES:
        table.add_row(f, str(cb[f]), str(cv[f]))
    table.add_row("tasks checked", str(len(base)), str(len(var)))
    table.add_row("seconds per task", f"{base_s / max(1, len(base)):.2f}", f"{var_s / max(1, len(var)):.2f}")
    console.print(table)
    out: dict[str, Any] = {f: cb[f] for f in FIGURES[:-1]} | {"validation_infra_errors": cb["infra_errors"]}
    out |= {f"variants_{f}": cv[f] for f in FIGURES}
    out |= {"validation_k": k, "validation_tasks_checked": len(base), "variants_checked": len(var),
            "suite_tasks": sum(not t.meta.get("perturbation") for t in tasks),
            "suite_generate_s": round(gen_s, 2), "validation_s_per_task": round(base_s / max(1, len(base)), 3),
            "code_repair_dropped": {s: ids for s, ids in (rb.dropped() | {f"variant_{s}": i for s, i in rv.dropped().items()}).items() if ids}}
    return out


def run(quick: bool, console) -> dict[str, Any]:  # noqa: ANN001 - a rich Console
    return code_repair_section(quick, console)
