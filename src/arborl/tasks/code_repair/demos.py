"""Demonstrations from the suite itself (`arborl envs demos code_repair`): a scripted expert that knows a
task's gold patch drives the white-box code agent's own tools (list_files, read_file, replace_in_file,
run_command) in the episode's sandbox, and the hidden tests then judge the final workspace exactly as
they judge a policy's episode. A demonstration whose workspace does not pass every hidden test is
dropped and counted, never written.

The expert's path varies with a seeded draw per (task, demo): list the files first or not (always on
medium / hard tiers, whose statements do not name the file), read the file before editing or not,
compile-check before and after or not, and the replaced span is the changed lines alone or with
context lines around them; its final answer (a reply without a tool call, which submits) is one of a
few phrasings. Each transcript is OpenAI ``messages`` + ``tools``, the input of `arborl sft`.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import random
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arborl.agents.recording import ScriptedClient, tool_call
from arborl.tasks.code_repair.store import RepairTask, read_files
from arborl.tasks.code_repair.suite import INFO_KEY, CodeRepairSuite
from arborl.types import Task

Action = tuple[str, dict[str, str]]  # (tool name, arguments); ("answer", {"content": ...}) ends the episode
_ANSWERS = ["Fixed the bug in `{path}`.", "I corrected `{path}`; the bug is fixed.", "Done: the fix is in `{path}`."]


def _replacements(old: str, new: str, context: int) -> list[tuple[str, str]]:
    """(old span, new span) edits turning ``old`` into ``new``: one per changed hunk, each span widened by
    ``context`` lines on each side, then further until it occurs exactly once in the file."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        lo, hi = max(0, i1 - context), min(len(a), i2 + context)
        while True:
            span = "".join(a[lo:hi])
            if span and old.count(span) == 1:
                break
            if lo == 0 and hi == len(a):
                break
            lo, hi = max(0, lo - 1), min(len(a), hi + 1)
        jlo, jhi = j1 - (i1 - lo), j2 + (hi - i2)
        out.append((span, "".join(b[jlo:jhi])))
    return out


def expert_plan(task: RepairTask, rng: random.Random, max_turns: int) -> list[Action]:
    """The scripted expert's actions for ``task``: varied exploration, the gold patch as replacements,
    a final answer; at most ``max_turns`` actions (optional steps are left out first)."""
    repo, gold = read_files(task.repo), task.gold_files()
    changed = [p for p in sorted(gold) if repo.get(p) != gold[p]]
    edits: list[Action] = []
    context = rng.choice([0, 0, 1, 2])
    for p in changed:
        for old, new in _replacements(repo.get(p, ""), gold[p], context):
            edits.append(("replace_in_file", {"path": p, "old": old, "new": new}))
    first = changed[0] if changed else ""
    listing = task.tier != "easy" or rng.random() < 0.3
    optional = {
        "list": [("list_files", {"path": "."})] if listing else [],
        "read": [("read_file", {"path": p}) for p in changed] if task.tier != "easy" or rng.random() < 0.8 else [],
        "check_before": [("run_command", {"command": f"python -m py_compile {first} && echo ok"})]
        if rng.random() < 0.2 else [],
        "check_after": [("run_command", {"command": f"python -m py_compile {first} && echo compiled"})]
        if rng.random() < 0.3 else [],
    }
    answer: Action = ("answer", {"content": rng.choice(_ANSWERS).format(path=first)})
    for drop in ("check_before", "check_after", "list", "read"):  # what goes first when turns run short
        n = sum(len(v) for v in optional.values()) + len(edits) + 1
        if n <= max_turns:
            break
        optional[drop] = []
    return [*optional["list"], *optional["read"], *optional["check_before"], *edits, *optional["check_after"], answer]


def _script(actions: list[Action]) -> Callable[[list[dict[str, Any]], int], dict[str, Any]]:
    def script(messages: list[dict[str, Any]], turn: int) -> dict[str, Any]:
        name, args = actions[min(turn, len(actions) - 1)]
        if name == "answer":
            return {"role": "assistant", "content": args["content"]}
        return {"role": "assistant", "content": "",
                "tool_calls": [tool_call(name, json.dumps(args, ensure_ascii=False), f"call_{turn}")]}

    return script


@dataclass
class DemoReport:
    demos: list[dict[str, Any]] = field(default_factory=list)  # kept transcripts (+ task facts)
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {task_id, passed, total, reason}

    def summary(self) -> dict[str, Any]:
        return {"kept": len(self.demos), "dropped": len(self.dropped),
                "tasks": len({d["task_id"] for d in self.demos} | {d["task_id"] for d in self.dropped})}


Planner = Callable[[RepairTask, random.Random, int], list[Action]]


async def make_demos(suite: CodeRepairSuite, tasks: list[Task], *, per_task: int = 2, seed: int = 0,
                     planner: Planner = expert_plan, concurrency: int = 2) -> DemoReport:
    """``per_task`` demonstrations of every task, each executed for real through the suite's episode (the
    code agent's tools in a fresh workspace of ``suite.runtime``, then the hidden tests); only those
    whose final workspace passes every hidden test are kept."""
    report = DemoReport()
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task, k: int) -> None:
        rt = suite.repair_task(task)
        actions = planner(rt, random.Random(f"{seed}:{rt.hash}:{k}"), suite.max_turns)
        client = ScriptedClient(_script(actions), session_id=f"demo-{rt.hash[:12]}-{k}")
        async with gate:
            outcome = await suite.agent({})(task, client)
        info = outcome.info.get(INFO_KEY, {})
        facts = {"task_id": task.task_id, "hash": rt.hash, "split": rt.split, "tier": rt.tier,
                 "template": rt.meta.get("template"), "passed": info.get("passed", 0), "total": info.get("total", 0)}
        if info.get("total") and info.get("passed") == info.get("total"):
            report.demos.append({**client.transcript(), **facts})
        else:
            report.dropped.append({**facts, "reason": "the final workspace fails hidden tests"})

    await asyncio.gather(*(one(t, k) for t in tasks for k in range(per_task)))
    report.demos.sort(key=lambda d: (d["task_id"], d["messages"][-1]["content"], len(d["messages"])))
    return report


_THOUGHTS = {"list_files": "Let me see the files of the repository.", "read_file": "Let me read {path}.",
             "run_command": "Let me check that it compiles.", "replace_in_file": "I fix the bug in {path}.",
             "answer": "The bug is fixed, so I submit."}


def shell_step(action: Action) -> dict[str, str]:
    """An expert action as a thought and one shell command (for harnesses whose only tool is a shell)."""
    name, args = action
    if name == "list_files":
        command = f"find {shlex.quote(args.get('path', '.'))} -type f -name '*.py' | sort"
    elif name == "read_file":
        command = f"cat -n {shlex.quote(args['path'])}"
    elif name == "run_command":
        command = args["command"]
    elif name == "replace_in_file":
        command = (f"python - <<'EOF'\np = {args['path']!r}\ns = open(p).read()\n"
                   f"open(p, 'w').write(s.replace({args['old']!r}, {args['new']!r}, 1))\nEOF")
    elif name == "answer":
        command = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
    else:
        raise ValueError(f"no shell form for the expert action {name!r}")
    return {"thought": _THOUGHTS[name].format(path=args.get("path", "")), "command": command}


async def make_rendered_demos(suite: CodeRepairSuite, tasks: list[Task], render: Sequence[str], *, per_task: int = 2,
                              seed: int = 0, planner: Planner = expert_plan, concurrency: int = 2) -> DemoReport:
    """Demonstrations in another harness's own format (X2: mini-swe-agent's, rendered by mini): ``render`` (a program run in each demo's sandbox) gets
    the task and the expert's steps as shell commands (JSON on stdin: {task, steps: [{thought, command}]}),
    executes them its own way and prints {"messages": [...]} as its last stdout line; the hidden tests then
    judge the workspace, and only passing demos are kept."""
    report = DemoReport()
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task, k: int) -> None:
        rt = suite.repair_task(task)
        steps = [shell_step(a) for a in planner(rt, random.Random(f"{seed}:{rt.hash}:{k}"), suite.max_turns)]
        facts = {"task_id": task.task_id, "hash": rt.hash, "split": rt.split, "tier": rt.tier,
                 "template": rt.meta.get("template")}
        async with gate:
            ws = await suite.prepare(task, episode_id=re.sub(r"[^A-Za-z0-9._-]", "_", f"render-{rt.hash[:12]}-{k}"))
            try:
                res = await suite.runtime.run(ws, list(render), stdin=json.dumps({"task": task.prompt, "steps": steps}),
                                              timeout_s=max(60.0, suite.command_timeout_s * len(steps)))
                verdict = await suite.evaluate(task, ws)
            finally:
                await suite.close(ws)
        try:
            transcript = json.loads(res.stdout.strip().splitlines()[-1])
            messages = transcript["messages"]
        except (IndexError, ValueError, KeyError, TypeError):
            report.dropped.append({**facts, "passed": verdict.passed, "total": len(verdict.results),
                                   "reason": f"the render program printed no transcript (exit {res.returncode}): "
                                             f"{res.stderr[-300:]}"})
            return
        facts.update(passed=verdict.passed, total=len(verdict.results))
        if verdict.all_pass:
            report.demos.append({"messages": messages, "tools": [], **facts})
        else:
            report.dropped.append({**facts, "reason": "the final workspace fails hidden tests"})

    await asyncio.gather(*(one(t, k) for t in tasks for k in range(per_task)))
    report.demos.sort(key=lambda d: (d["task_id"], d["messages"][-1]["content"], len(d["messages"])))
    return report


def write_demos(cfg: Any, out: Any, *, split: str = "train", per_task: int = 2, limit: int = 0,
                seed: int | None = None, render: Sequence[str] = ()) -> dict[str, Any]:
    """`arborl envs demos code_repair`: demonstrations of the ``split`` tasks the config allows, written to
    ``out`` (JSONL); returns the counts (kept, dropped, tasks) and the path."""
    r = cfg.rollout
    suite = CodeRepairSuite(r.code_repair, envs=r.envs, max_turns=r.max_turns)
    pool = suite.pool(split)
    tasks = [suite._task(t) for t in (pool[:limit] if limit else pool)]
    seed = cfg.seed if seed is None else seed
    if render:
        argv = [str(Path(a).absolute()) if Path(a).is_file() else a for a in render]
        report = asyncio.run(make_rendered_demos(suite, tasks, argv, per_task=per_task, seed=seed))
    else:
        report = asyncio.run(make_demos(suite, tasks, per_task=per_task, seed=seed))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in report.demos))
    return {**report.summary(), "out": str(out), "split": split}
