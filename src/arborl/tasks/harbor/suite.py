"""The ``harbor`` task suite (X1): Harbor task folders (``rollout.task=harbor``, knobs ``rollout.harbor.*``).

An episode (``HarborEpisode``) is: a fresh bubblewrap workspace built from the task's ``environment/``
(``task_folder.py`` says what a Dockerfile may hold) shown at its workdir (``/app`` by default), the
agent working in it (the built-in code agent with ``instruction.md`` as the prompt, or a black-box
program inside the sandbox with ``rollout.agent=command``), then the verifier: ``bash /tests/test.sh``
in a separate sandbox over a copy of the final workspace, with ``tests/`` at ``/tests`` and a writable
``/logs/verifier``, exactly as Harbor runs it. The reward is what the verifier wrote:
``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (its ``reward`` key, or the mean of its
numbers; every number is also a reward component). ``outcome`` is that reward; success is
``outcome >= 1``.

Splits are fixed by a hash of each task's name (``rollout.harbor.eval_fraction``) unless its
``task.toml`` says ``[metadata] split``. Tasks that need a container image are refused (each with its
reason, shown by ``arborl envs validate harbor``) and never drawn.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborl.agents import AgentLoop, AgentOutcome, SessionClient
from arborl.agents.code_agent import code_agent
from arborl.agents.sandboxed import SandboxedCommand
from arborl.envs.base import CommandResult, EnvError, Runtime, Workspace
from arborl.tasks.dataset import draw_rows
from arborl.tasks.harbor.task_folder import HarborTask, build_template, read_tasks
from arborl.types import Call, Task

if TYPE_CHECKING:
    from arborl.config import EnvsConfig, HarborConfig

INFO_KEY = "harbor"
SYSTEM_PROMPT = (
    "You are an engineer working in a Linux terminal. Your current directory holds the files of the task. Use "
    "the tools to look at files, edit them and run commands. When the task is done, answer with a short summary "
    "and no tool call: that submits your work. Hidden tests then check it."
)
_MARK = "@@arborl-harbor@@"
# the verifier's own output goes to stderr; stdout carries only what the reward files hold
VERIFY = (
    "bash /tests/test.sh 1>&2; rc=$?; "
    f"printf '\\n{_MARK} rc %s\\n' \"$rc\"; "
    "for f in reward.txt reward.json; do "
    f"if [ -f /logs/verifier/$f ]; then printf '{_MARK} %s\\n' \"$f\"; head -c 65536 /logs/verifier/$f; echo; fi; "
    "done"
)


@dataclass
class Verdict:
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    returncode: int | None = None
    timed_out: bool = False
    error: str | None = None  # the verifier wrote no (readable) reward
    output: str = ""  # the verifier's output tail

    def info(self) -> dict[str, Any]:
        return {"reward": self.reward, "components": dict(self.components), "returncode": self.returncode,
                "timed_out": self.timed_out, "error": self.error, "output_tail": self.output[-2000:]}


def read_verdict(res: CommandResult) -> Verdict:
    """The reward the verifier wrote, from the wrapper's stdout (``VERIFY``)."""
    sections: dict[str, str] = {}
    key = None
    for line in res.stdout.splitlines():
        if line.startswith(_MARK):
            key = line[len(_MARK):].strip()
            if key.startswith("rc "):
                sections["rc"], key = key[3:], None
            else:
                sections[key] = ""
        elif key is not None:
            sections[key] += line + "\n"
    rc = int(sections["rc"]) if sections.get("rc", "").strip().lstrip("-").isdigit() else None
    out = res.stderr[-4000:]
    if res.timed_out:
        return Verdict(0.0, returncode=rc, timed_out=True, error="the verifier ran past its time limit", output=out)
    if "reward.json" in sections:
        try:
            data = json.loads(sections["reward.json"])
        except json.JSONDecodeError as e:
            return Verdict(0.0, returncode=rc, error=f"reward.json is not JSON: {e}", output=out)
        numbers = {str(k): float(v) for k, v in (data.items() if isinstance(data, dict) else [])
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if not numbers:
            return Verdict(0.0, returncode=rc, error="reward.json holds no numbers", output=out)
        reward = numbers.get("reward", sum(numbers.values()) / len(numbers))
        return Verdict(reward, {k: v for k, v in numbers.items() if k not in ("reward", "outcome")}, rc, output=out)
    if "reward.txt" in sections:
        try:
            reward = float(sections["reward.txt"].strip())
        except ValueError:
            return Verdict(0.0, returncode=rc, error=f"reward.txt is not a number: {sections['reward.txt'][:80]!r}", output=out)
        if not math.isfinite(reward):
            return Verdict(0.0, returncode=rc, error=f"reward.txt is {reward}", output=out)
        return Verdict(reward, {}, rc, output=out)
    return Verdict(0.0, returncode=rc, error="the verifier wrote neither /logs/verifier/reward.txt nor reward.json",
                   output=out)


@dataclass
class HarborEnv:
    """What an inner agent gets for one episode: the runtime, the workspace and the task."""

    runtime: Runtime
    workspace: Workspace
    task: HarborTask


class HarborEpisode:
    """An AgentLoop: workspace, inner agent, verifier, close."""

    def __init__(self, suite: "HarborSuite", inner: Any) -> None:
        self.suite = suite
        self.inner = inner

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome:
        ht = self.suite.task_of(task)
        runtime = self.suite.runtime_for(ht)
        ws = await runtime.prepare(self.suite.template(ht), episode_id=re.sub(r"[^A-Za-z0-9._-]", "_", client.session_id))
        try:
            outcome = await self.inner(task, client, HarborEnv(runtime, ws, ht)) or AgentOutcome()
            verdict = await self.suite.verify(ht, runtime, ws)
        finally:
            await runtime.close(ws)
        outcome.info[INFO_KEY] = verdict.info()
        return outcome


class HarborSuite:
    name = "harbor"

    def __init__(self, cfg: "HarborConfig", *, envs: "EnvsConfig", max_turns: int = 8,
                 command_timeout_s: float = 30.0, runtime_factory: Any = None) -> None:
        if not cfg.tasks_dir:
            raise EnvError("rollout.task=harbor needs rollout.harbor.tasks_dir: a directory of Harbor task folders")
        if envs.runtime == "local" and runtime_factory is None:
            raise EnvError("rollout.task=harbor runs its verifier at /tests and /logs/verifier, which the local runtime "
                           "cannot show: use rollout.envs.runtime=bwrap")
        self.cfg = cfg
        self.envs = envs
        self.max_turns = max_turns
        self.command_timeout_s = command_timeout_s
        self.all_tasks = read_tasks(Path(cfg.tasks_dir), cfg.host_images)
        self.by_name = {t.name: t for t in self.all_tasks}
        self.refused = {t.name: t.refusal for t in self.all_tasks if t.refusal}
        self._runtimes: dict[str, Runtime] = {}
        self._runtime_factory = runtime_factory
        self._templates: dict[str, Path] = {}

    # -- tasks ----------------------------------------------------------------------------------------
    def pool(self, split: str) -> list[HarborTask]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        out = [t for t in self.all_tasks if not t.refusal and t.split(self.cfg.eval_fraction) == split]
        if not out:
            refused = f"; refused: {', '.join(f'{k} ({v})' for k, v in self.refused.items())}" if self.refused else ""
            raise EnvError(f"no runnable Harbor tasks for split {split!r} in {self.cfg.tasks_dir} (rollout.harbor."
                           f"eval_fraction={self.cfg.eval_fraction}, or [metadata] split in task.toml){refused}")
        return out

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        pool = self.pool(split)
        if split == "eval":
            return [self._task(t) for t in pool[:n]]
        return draw_rows([self._task(t) for t in pool], n, seed)

    def _task(self, t: HarborTask) -> Task:
        return Task(task_id=f"harbor-{t.name}", prompt=t.instruction, split=t.split(self.cfg.eval_fraction),
                    metadata={"harbor_task": t.name})

    def task_of(self, task: Task) -> HarborTask:
        name = task.metadata.get("harbor_task")
        if name not in self.by_name:
            raise EnvError(f"task {task.task_id!r} is not a task of {self.cfg.tasks_dir}")
        return self.by_name[name]

    # -- an episode's environment --------------------------------------------------------------------
    def runtime_for(self, t: HarborTask) -> Runtime:
        """A runtime showing workspaces at the task's workdir (one per workdir)."""
        if t.workdir not in self._runtimes:
            envs = self.envs.model_copy(update={"workspace_path": t.workdir})
            if self._runtime_factory is not None:
                self._runtimes[t.workdir] = self._runtime_factory(envs)
            else:
                from arborl.envs import make_runtime

                self._runtimes[t.workdir] = make_runtime(envs)
        return self._runtimes[t.workdir]

    def template(self, t: HarborTask) -> Path:
        """The task's workspace template, built once per folder content under the sandbox root."""
        if t.name not in self._templates:
            from arborl.envs.host import own_root

            dest = own_root(self.envs.root_dir) / "harbor-templates" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', t.name)}-{t.digest()}"
            if not dest.is_dir():
                staging = dest.with_name(dest.name + f".new-{random.getrandbits(32):x}")
                build_template(t, staging)
                try:
                    staging.rename(dest)
                except OSError:  # another process built it first
                    import shutil

                    shutil.rmtree(staging, ignore_errors=True)
            self._templates[t.name] = dest
        return self._templates[t.name]

    async def verify(self, t: HarborTask, runtime: Runtime, ws: Workspace) -> Verdict:
        timeout = min(self.cfg.verifier_timeout_s, t.verifier_timeout_s or math.inf)
        res = await runtime.evaluate(ws, t.tests_dir, ["bash", "-c", VERIFY], timeout_s=timeout, env=dict(t.env),
                                     mounts={"/tests": t.tests_dir.name, "/logs/verifier": ".harbor-logs/verifier"})
        return read_verdict(res)

    # -- the protocol ---------------------------------------------------------------------------------
    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        async def inner(task: Task, client: SessionClient, env: HarborEnv) -> AgentOutcome:
            agent = code_agent(env.runtime, env.workspace, sampling, max_turns=self.max_turns,
                               timeout_s=self.command_timeout_s, system_prompt=SYSTEM_PROMPT)
            return await agent(task, client)

        return HarborEpisode(self, inner)

    def command_agent(self, command: list[str], sampling: dict[str, Any], timeout_s: float) -> AgentLoop:
        """A black-box program as the agent, inside the episode's sandbox (``rollout.agent=command``)."""

        async def inner(task: Task, client: SessionClient, env: HarborEnv) -> AgentOutcome:
            limit = min(timeout_s, env.task.agent_timeout_s or math.inf)
            return await SandboxedCommand(command, runtime=env.runtime, workspace=env.workspace, sampling=sampling,
                                          timeout_s=limit)(task, client)

        return HarborEpisode(self, inner)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        info = outcome.info.get(INFO_KEY) if outcome is not None else None
        if not isinstance(info, dict):
            raise EnvError(f"episode of task {task.task_id!r} has no verifier result: harbor episodes must run through "
                           "the suite's agent (HarborEpisode)")
        return {"outcome": float(info["reward"]), **{k: float(v) for k, v in info["components"].items()}}


async def run_solution(suite: HarborSuite, t: HarborTask, *, episode_id: str) -> Verdict:
    """The oracle: ``solution/solve.sh`` in a fresh workspace, then the verifier (validation, demos)."""
    runtime = suite.runtime_for(t)
    ws = await runtime.prepare(suite.template(t), episode_id=episode_id)
    try:
        await runtime.run(ws, ["bash", "-c", solution_script(t)], timeout_s=suite.command_timeout_s, env=dict(t.env))
        return await suite.verify(t, runtime, ws)
    finally:
        await runtime.close(ws)


def solution_script(t: HarborTask) -> str:
    solve = t.solution_dir / "solve.sh"
    if not solve.is_file():
        raise EnvError(f"{t.path}: no solution/solve.sh")
    return solve.read_text()


async def run_noop(suite: HarborSuite, t: HarborTask, *, episode_id: str) -> Verdict:
    runtime = suite.runtime_for(t)
    ws = await runtime.prepare(suite.template(t), episode_id=episode_id)
    try:
        return await suite.verify(t, runtime, ws)
    finally:
        await runtime.close(ws)
