"""`arborl envs validate harbor` and `arborl envs demos harbor`: every task folder checked in the sandbox
(E3: its solution passes, the untouched workspace fails, k times alike), and its solution turned into an
SFT demonstration through the code agent's own tool.

A demonstration is the transcript of the built-in code agent whose one tool call runs ``solution/solve.sh``
(``run_command``), then a final answer; it is executed for real in a fresh workspace and kept only if the
verifier then gives reward >= 1, like any episode.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from arborl.agents.recording import ScriptedClient, tool_call
from arborl.envs.base import InfraError
from arborl.tasks.harbor.suite import INFO_KEY, HarborSuite, run_noop, run_solution, solution_script
from arborl.tasks.harbor.task_folder import HarborTask


async def validate_task(suite: HarborSuite, t: HarborTask, k: int) -> dict[str, Any]:
    """One task's status: refused, no_solution, validated, gold_fails, noop_passes, flaky or infra_error."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"task": t.name, "split": t.split(suite.cfg.eval_fraction)}
    if t.refusal:
        return {**rec, "status": "refused", "reason": t.refusal}
    if not (t.solution_dir / "solve.sh").is_file():
        return {**rec, "status": "no_solution", "reason": "no solution/solve.sh to check the verifier with"}
    safe = "".join(c if c.isalnum() else "_" for c in t.name)[:60]
    try:
        gold = [await run_solution(suite, t, episode_id=f"val-{safe}-gold-{i}") for i in range(k)]
        noop = [await run_noop(suite, t, episode_id=f"val-{safe}-noop-{i}") for i in range(k)]
    except InfraError as e:
        return {**rec, "status": "infra_error", "reason": str(e)}
    rec.update(gold=[g.reward for g in gold], noop=[n.reward for n in noop], seconds=round(time.perf_counter() - t0, 2))
    if len({g.reward for g in gold}) > 1 or len({n.reward for n in noop}) > 1:
        return {**rec, "status": "flaky", "reason": "the verifier gave different rewards on the same workspace"}
    if gold[0].reward < 1.0:
        why = gold[0].error or f"reward {gold[0].reward}"
        return {**rec, "status": "gold_fails", "reason": f"the solution does not pass: {why}; {gold[0].output[-300:]}"}
    if noop[0].reward >= 1.0:
        return {**rec, "status": "noop_passes", "reason": "the untouched workspace already passes"}
    return {**rec, "status": "validated"}


def validate_harbor(suite: HarborSuite, *, k: int = 2, jobs: int = 2) -> dict[str, Any]:
    """Every task folder's status and the counts (the report `arborl envs validate harbor` prints)."""

    async def all_tasks() -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(jobs)

        async def one(t: HarborTask) -> dict[str, Any]:
            async with gate:
                return await validate_task(suite, t, k)

        return list(await asyncio.gather(*(one(t) for t in suite.all_tasks)))

    results = asyncio.run(all_tasks())
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return {"suite": "harbor", "tasks_dir": suite.cfg.tasks_dir, "k": k, "tasks": len(results), **counts,
            "results": results}


def _demo_script(script: str, answer: str):  # noqa: ANN202
    def reply(messages: list[dict[str, Any]], turn: int) -> dict[str, Any]:
        if turn == 0:
            return {"role": "assistant", "content": "",
                    "tool_calls": [tool_call("run_command", json.dumps({"command": script}), "call_0")]}
        return {"role": "assistant", "content": answer}

    return reply


async def make_demos(suite: HarborSuite, tasks: list[HarborTask]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept demonstrations, dropped) for ``tasks``: each solution run through the code agent's tool."""
    kept, dropped = [], []
    for t in tasks:
        task = suite._task(t)
        client = ScriptedClient(_demo_script(solution_script(t), "Done: the task is complete."),
                                session_id=f"demo-{''.join(c if c.isalnum() else '_' for c in t.name)[:60]}")
        outcome = await suite.agent({})(task, client)
        info = outcome.info.get(INFO_KEY, {})
        facts = {"task_id": task.task_id, "split": task.split, "reward": info.get("reward")}
        if (info.get("reward") or 0.0) >= 1.0:
            kept.append({**client.transcript(), **facts})
        else:
            dropped.append({**facts, "reason": info.get("error") or "the verifier's reward is below 1"})
    return kept, dropped


def write_demos(suite: HarborSuite, out: Path, *, split: str = "train") -> dict[str, Any]:
    tasks = [t for t in suite.pool(split) if (t.solution_dir / "solve.sh").is_file()]
    kept, dropped = asyncio.run(make_demos(suite, tasks))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in kept))
    return {"kept": len(kept), "dropped": len(dropped), "tasks": len(tasks), "out": str(out), "split": split,
            "dropped_tasks": dropped}
