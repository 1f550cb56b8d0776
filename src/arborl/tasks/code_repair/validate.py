"""E3: a task is used only if its gold patch passes, the unchanged repo (the no-op) fails, and both
give the same per-test results on each of ``k`` runs, all in the sandbox.

Results are cached per task hash in ``<suite root>/validation.json``; a cached result made with at
least ``k`` runs is reused. An infrastructure failure (the sandbox would not start) is reported and
not cached: it says nothing about the task.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from arborl.envs.base import InfraError, Runtime
from arborl.tasks.code_repair.catalog import locked
from arborl.tasks.code_repair.scoring import Verdict, run_hidden_tests
from arborl.tasks.code_repair.store import RepairTask

STATUSES = ("validated", "gold_fails", "noop_passes", "flaky")
COUNTS = {"validated": "validated_tasks", "gold_fails": "dropped_gold_fails", "noop_passes": "dropped_noop_passes",
          "flaky": "dropped_flaky"}


@dataclass
class TaskValidation:
    hash: str
    status: str  # one of STATUSES, or "infra_error" (not cached)
    k: int
    gold: list[dict[str, str]] = field(default_factory=list)  # per-test results of each gold run
    noop: list[dict[str, str]] = field(default_factory=list)  # ... of each no-op run
    seconds: float = 0.0
    error: str | None = None


@dataclass
class ValidationReport:
    results: dict[str, TaskValidation]  # task id -> its validation

    def counts(self) -> dict[str, int]:
        out = {name: 0 for name in COUNTS.values()} | {"infra_errors": 0}
        for r in self.results.values():
            out[COUNTS.get(r.status, "infra_errors")] += 1
        return out

    def dropped(self) -> dict[str, list[str]]:
        return {s: sorted(i for i, r in self.results.items() if r.status == s) for s in STATUSES[1:] + ("infra_error",)}


class ValidationCache:
    """``validation.json``: task hash -> its TaskValidation (as a dict)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / "validation.json"

    def load(self) -> dict[str, dict[str, Any]]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except json.JSONDecodeError:
            return {}  # a torn or hand-edited cache is revalidated, never trusted
        return data if isinstance(data, dict) else {}

    def get(self, task_hash: str, k: int) -> TaskValidation | None:
        rec = self.load().get(task_hash)
        if not isinstance(rec, dict) or rec.get("k", 0) < k or rec.get("status") not in STATUSES:
            return None
        return TaskValidation(**rec)

    def put(self, results: Iterable[TaskValidation]) -> None:
        with locked(self.root):
            data = self.load()
            data.update({r.hash: asdict(r) for r in results if r.status in STATUSES})
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)

    def statuses(self) -> dict[str, str]:
        return {h: r.get("status", "") for h, r in self.load().items() if isinstance(r, dict)}


def _classify(gold: list[Verdict], noop: list[Verdict]) -> str:
    if len({tuple(sorted(v.results.items())) for v in gold}) > 1 or len({tuple(sorted(v.results.items())) for v in noop}) > 1:
        return "flaky"
    if not gold[0].all_pass:
        return "gold_fails"
    if noop[0].all_pass:
        return "noop_passes"
    return "validated"


async def _runs(runtime: Runtime, task: RepairTask, *, gold: bool, k: int, timeout_s: float, tag: str) -> list[Verdict]:
    ws = await runtime.prepare(task.repo, episode_id=f"validate-{task.hash[:12]}-{tag}-{secrets.token_hex(4)}")
    try:
        if gold:
            for rel, text in task.gold_files().items():
                (ws.path / rel).write_text(text)
        return [await run_hidden_tests(runtime, ws, task, timeout_s=timeout_s) for _ in range(k)]
    finally:
        await runtime.close(ws)


async def validate_task(runtime: Runtime, task: RepairTask, *, k: int = 3, timeout_s: float = 60.0) -> TaskValidation:
    """Gold ``k`` times, the no-op ``k`` times, and the verdict."""
    t0 = time.perf_counter()
    try:
        gold = await _runs(runtime, task, gold=True, k=k, timeout_s=timeout_s, tag="gold")
        noop = await _runs(runtime, task, gold=False, k=k, timeout_s=timeout_s, tag="noop")
    except InfraError as e:
        return TaskValidation(task.hash, "infra_error", k, seconds=time.perf_counter() - t0, error=str(e))
    return TaskValidation(task.hash, _classify(gold, noop), k, [v.results for v in gold], [v.results for v in noop],
                          time.perf_counter() - t0)


async def validate_tasks(
    runtime: Runtime,
    tasks: list[RepairTask],
    *,
    k: int = 3,
    timeout_s: float = 60.0,
    jobs: int = 2,
    cache: ValidationCache | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ValidationReport:
    """Validate ``tasks`` (``jobs`` at once), reusing and filling ``cache``."""
    results: dict[str, TaskValidation] = {}
    todo = []
    for t in tasks:
        hit = cache.get(t.hash, k) if cache is not None else None
        if hit is not None:
            results[t.id] = hit
        else:
            todo.append(t)
    sem = asyncio.Semaphore(max(1, jobs))
    done = len(results)

    async def one(t: RepairTask) -> None:
        nonlocal done
        async with sem:
            results[t.id] = await validate_task(runtime, t, k=k, timeout_s=timeout_s)
        done += 1
        if progress is not None:
            progress(done, len(tasks))

    await asyncio.gather(*(one(t) for t in todo))
    if cache is not None and todo:
        cache.put(results[t.id] for t in todo)
    return ValidationReport({t.id: results[t.id] for t in tasks})
