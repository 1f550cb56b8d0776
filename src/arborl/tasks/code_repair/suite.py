"""The ``code_repair`` task suite: fix the bug in a small repository; reward = hidden tests passed.

An episode (``RepairEpisode``, what ``agent()`` returns) is: a fresh workspace from the task's buggy
repo (``runtime.prepare``), the inner agent working in it through a ``RepairEnv`` (the workspace, the
runtime, the task), then the hidden tests run against the final workspace in a separate sandbox
(``runtime.evaluate``), then the workspace is closed. The tests' per-test results go into the
outcome's ``info["code_repair"]`` (kept with the episode); ``score`` turns them into the components
``outcome`` (1.0 when every hidden test passes) and ``tests_passed_frac``.

Tasks come from the materialised suite (``catalog.py``), filtered by tier, split (fixed by each task's
hash; a variant keeps its origin's), and validation (``validate.py``): by default only tasks whose
validation passed are drawn.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from arborl.agents import AgentLoop, AgentOutcome, SessionClient
from arborl.agents.code_agent import code_agent
from arborl.agents.sandboxed import SandboxedCommand
from arborl.envs.base import CommandResult, EnvError, Runtime, Workspace
from arborl.tasks.code_repair.catalog import materialise, suite_root
from arborl.tasks.code_repair.scoring import Verdict, run_hidden_tests
from arborl.tasks.code_repair.store import RepairTask, read_files
from arborl.tasks.dataset import draw_rows
from arborl.tasks.code_repair.validate import ValidationCache
from arborl.types import Call, Task

if TYPE_CHECKING:
    from arborl.config import CodeRepairConfig, EnvsConfig

INFO_KEY = "code_repair"


@dataclass
class RepairEnv:
    """What an inner agent gets for one episode: its workspace (``workspace.path`` on the host), the
    runtime that runs commands in it, and the task (statement, tier; never the hidden tests)."""

    runtime: Runtime
    workspace: Workspace
    task: RepairTask

    async def run(self, argv: list[str], *, timeout_s: float | None = None, stdin: str | None = None) -> CommandResult:
        return await self.runtime.run(self.workspace, argv, timeout_s=timeout_s, stdin=stdin)


class WorkspaceAgent(Protocol):
    """The agent inside a code-repair episode: edits ``env.workspace`` and returns when done."""

    async def __call__(self, task: Task, client: SessionClient, env: RepairEnv) -> AgentOutcome | None: ...


async def submit_unchanged(task: Task, client: SessionClient, env: RepairEnv) -> AgentOutcome:
    """The no-op inner agent: submits the workspace as it found it (reward 0 on a validated task)."""
    return AgentOutcome(answer="")


class RepairEpisode:
    """An AgentLoop: workspace, inner agent, hidden tests, close."""

    def __init__(self, suite: "CodeRepairSuite", inner: WorkspaceAgent) -> None:
        self.suite = suite
        self.inner = inner

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome:
        ws = await self.suite.prepare(task, episode_id=client.session_id)
        try:
            outcome = await self.inner(task, client, RepairEnv(self.suite.runtime, ws, self.suite.repair_task(task)))
            outcome = outcome or AgentOutcome()
            verdict = await self.suite.evaluate(task, ws)
            change = await asyncio.to_thread(workspace_diff, self.suite.repair_task(task).repo, ws.path)
        finally:
            await self.suite.close(ws)
        outcome.info[INFO_KEY] = {**verdict.info(), "diff": change}
        return outcome


def source_key(t: RepairTask) -> str:
    """A task's code: its buggy repository and its gold patch, without the hidden tests. Two tasks of a template
    can draw the same code with other test values; such an eval task is no held-out task for a train one."""
    h = hashlib.sha256()
    for part in (read_files(t.repo), t.gold_files()):
        for rel, text in sorted(part.items()):
            h.update(f"{len(rel)}:{rel}{len(text)}:{text}".encode())
        h.update(b"|")
    return h.hexdigest()


def _regular_files(root: Path, limit: int) -> dict[str, str]:
    """Text of the regular files under ``root`` (symlinks and special files are never followed)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", ".git")]
        for name in filenames:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                    continue
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    out[str(p.relative_to(root))] = f.read(limit).decode("utf-8", "replace")
            except OSError:
                continue
    return out


def workspace_diff(template: Path, workspace: Path, *, max_file_bytes: int = 200_000) -> str:
    """The agent's change: a unified diff of the final workspace against the task's repository."""
    before, after = _regular_files(template, max_file_bytes), _regular_files(workspace, max_file_bytes)
    parts = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a == b:
            continue
        parts += difflib.unified_diff((a or "").splitlines(keepends=True), (b or "").splitlines(keepends=True),
                                      "/dev/null" if a is None else f"a/{name}", "/dev/null" if b is None else f"b/{name}")
    return "".join(parts)


class CodeRepairSuite:
    name = "code_repair"

    def __init__(
        self,
        cfg: "CodeRepairConfig",
        *,
        envs: "EnvsConfig | None" = None,
        runtime: Runtime | None = None,
        inner: WorkspaceAgent | None = None,
        max_turns: int = 8,
        command_timeout_s: float = 30.0,
    ) -> None:
        self.cfg = cfg
        self.root = suite_root(cfg)
        self.all_tasks = materialise(self.root, cfg.seed, cfg.per_template, variants=cfg.variants or cfg.eval_perturbed)
        self._by_hash = {t.hash: t for t in self.all_tasks}
        self.cache = ValidationCache(self.root)
        self._train_keys: set[str] | None = None
        self._envs = envs
        self._runtime = runtime
        self.inner = inner  # None: the built-in code agent (agents/code_agent.py)
        self.max_turns = max_turns
        self.command_timeout_s = command_timeout_s

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            from arborl.envs import make_runtime

            self._runtime = make_runtime(self._envs)
        return self._runtime

    # -- tasks ----------------------------------------------------------------------------------------
    @property
    def eval_splits(self) -> tuple[str, ...]:
        """The held-out splits a run evaluates: eval, and eval_perturbed (the held-out tasks' variants, E5)
        with ``eval_perturbed``."""
        return ("eval", "eval_perturbed") if self.cfg.eval_perturbed else ("eval",)

    def pool(self, split: str) -> list[RepairTask]:
        """The tasks of ``split`` that the tier and validation knobs allow, in a fixed order. ``train`` holds the
        train tasks' perturbed variants too with ``variants``; ``eval`` is the held-out base tasks only, so its
        figures stay comparable whatever trains; ``eval_perturbed``: the perturbed variants of the eval split's
        tasks. A held-out task whose code (repository and gold patch) equals a train task's is left out."""
        if split not in ("train", "eval", "eval_perturbed"):
            raise ValueError(f"split must be 'train', 'eval' or 'eval_perturbed', got {split!r}")
        statuses = self.cache.statuses()
        ok = {"validated"} if self.cfg.require_validated else {"validated", ""}

        def wanted(t: RepairTask) -> bool:
            variant = bool(t.meta.get("perturbation"))
            if split == "eval_perturbed":
                return t.split == "eval" and variant
            return t.split == split and (split == "train" and self.cfg.variants or not variant)

        out = [t for t in self.all_tasks if wanted(t) and self.cfg.tier in ("all", t.tier)
               and statuses.get(t.hash, "") in ok]
        if split != "train":  # held out means unseen code: not a train task's repository and fix with other test
            seen = self._train_sources()  # values, nor a variant of such a task
            origin = self._by_hash.get
            out = [t for t in out if source_key(t) not in seen
                   and source_key(origin(t.meta.get("variant_of", ""), t)) not in seen]
        if not out:
            tier = f" --tier {self.cfg.tier}" if self.cfg.tier != "all" else ""
            raise EnvError(
                f"no {'validated ' if self.cfg.require_validated else ''}code-repair tasks for split {split!r}, tier "
                f"{self.cfg.tier!r} in {self.root}: run `arborl envs validate code_repair{tier}` first"
                + (" (or set rollout.code_repair.require_validated=false)" if self.cfg.require_validated else ""))
        return sorted(out, key=lambda t: t.id)

    def _train_sources(self) -> set[str]:
        if self._train_keys is None:
            self._train_keys = {source_key(t) for t in self.all_tasks if t.split == "train"}
        return self._train_keys

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        pool = self.pool(split)
        if split != "train":
            return [self._task(t) for t in pool[:n]]
        return draw_rows([self._task(t) for t in pool], n, seed)

    def _task(self, t: RepairTask) -> Task:
        return Task(task_id=t.id, prompt=t.statement, split=t.split,
                    metadata={"hash": t.hash, "tier": t.tier, "template": t.meta["template"],
                              "perturbation": t.meta.get("perturbation")})  # no test names: hard tasks give only the symptom

    def repair_task(self, task: Task) -> RepairTask:
        h = task.metadata.get("hash")
        if h not in self._by_hash:
            raise EnvError(f"task {task.task_id!r} is not a task of the code_repair suite in {self.root} "
                           "(its metadata has no known 'hash')")
        return self._by_hash[h]

    # -- an episode's environment --------------------------------------------------------------------
    async def prepare(self, task: Task, *, episode_id: str) -> Workspace:
        return await self.runtime.prepare(self.repair_task(task).repo, episode_id=re.sub(r"[^A-Za-z0-9._-]", "_", episode_id))

    async def evaluate(self, task: Task, ws: Workspace) -> Verdict:
        return await run_hidden_tests(self.runtime, ws, self.repair_task(task), timeout_s=self.cfg.test_timeout_s)

    async def close(self, ws: Workspace) -> None:
        await self.runtime.close(ws)

    # -- the protocol ---------------------------------------------------------------------------------
    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        """The episode with the built-in white-box code agent (or the ``inner`` agent given)."""
        if self.inner is not None:
            return RepairEpisode(self, self.inner)

        async def inner(task: Task, client: SessionClient, env: RepairEnv) -> AgentOutcome:
            agent = code_agent(env.runtime, env.workspace, sampling, max_turns=self.max_turns,
                               timeout_s=self.command_timeout_s)
            return await agent(task, client)

        return RepairEpisode(self, inner)

    def command_agent(self, command: list[str], sampling: dict[str, Any], timeout_s: float) -> AgentLoop:
        """The episode with a black-box program as its agent, run inside the episode's sandbox
        (``rollout.agent=command``): its shell commands and edits act on the workspace."""

        async def inner(task: Task, client: SessionClient, env: RepairEnv) -> AgentOutcome:
            return await SandboxedCommand(command, runtime=env.runtime, workspace=env.workspace, sampling=sampling,
                                          timeout_s=timeout_s)(task, client)

        return RepairEpisode(self, inner)

    def judge_input(self, task: Task, outcome: AgentOutcome | None) -> tuple[str, str] | None:
        """What the judge (rollout.judge) sees: the statement and the agent's change as a diff."""
        info = outcome.info.get(INFO_KEY) if outcome is not None else None
        if not isinstance(info, dict) or not info.get("passed"):
            return None  # nothing to judge where no hidden test passed
        return task.prompt if isinstance(task.prompt, str) else str(task.prompt), info.get("diff", "")

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        info = outcome.info.get(INFO_KEY) if outcome is not None else None
        if not isinstance(info, dict):
            raise EnvError(f"episode of task {task.task_id!r} has no hidden-test results: code_repair episodes must "
                           "run through the suite's agent (RepairEpisode), which evaluates the final workspace")
        total = info["total"]
        passed = info["passed"]
        return {"outcome": 1.0 if total and passed == total else 0.0,
                "tests_passed_frac": passed / total if total else 0.0}
