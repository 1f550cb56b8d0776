"""The ``verifiers`` task suite (X1): a verifiers (0.4, ``verifiers.v1``) environment (``rollout.task=verifiers``,
knobs ``rollout.verifiers.*``).

The environment runs in the interpreter it is installed in (``rollout.verifiers.python``; ``make verifiers``
makes ``.venv-vf``) through ``verifiers_bridge.py``, which imports nothing of arborl: its dependency pins
never meet arborl's. The suite lists the taskset once (``bridge list``) and splits it by a hash of each
task's key (``rollout.verifiers.eval_fraction``, the same split every run). An episode is the bridge's
``run`` as a black-box program (the ``command`` agent's path): verifiers runs the environment as it
always does -- its ``Env.run`` with the multi-turn environment responses, its rewards, ``finalize`` --
and every model turn reaches this run's gateway over HTTP, so each token is recorded and trained. The
score: ``outcome`` is verifiers' episode reward (the weighted sum of its rewards; success is outcome
>= 1), and each reward's score is a component under its own name (``train.advantage.shaping.
component_weights`` can weigh them).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborl.agents import AgentLoop, AgentOutcome
from arborl.agents.command import CommandAgent
from arborl.config import ConfigError
from arborl.tasks.dataset import copy_task, draw_rows
from arborl.types import Call, Task

if TYPE_CHECKING:
    from arborl.config import RolloutConfig

BRIDGE = Path(__file__).with_name("verifiers_bridge.py")


class VerifiersEnvError(ConfigError):
    """The verifiers environment cannot be listed or run; the message says what to fix."""


class VerifiersSuite:
    name = "verifiers"

    def __init__(self, rollout: "RolloutConfig") -> None:
        cfg = rollout.verifiers
        if not cfg.env:
            raise VerifiersEnvError("rollout.task=verifiers needs rollout.verifiers.env: an installed environment id "
                                    "or path/to/env.py[:Taskset]")
        self.cfg = cfg
        self.rollout = rollout
        self.python = cfg.python or sys.executable
        rows = self._list()
        self.rows: dict[str, list[Task]] = {"train": [], "eval": []}
        for row in rows:
            h = int(hashlib.sha256(row["key"].encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
            split = "eval" if h < cfg.eval_fraction else "train"
            prompt = row["prompt"] if row["prompt"] is not None else ""
            self.rows[split].append(Task(task_id=f"vf-{row['idx']}", prompt=prompt, split=split,
                                         metadata={"idx": row["idx"], "key": row["key"]}))
        if not self.rows["train"]:
            raise VerifiersEnvError(f"{cfg.env}: no training tasks among its {len(rows)} (rollout.verifiers.eval_fraction"
                                    f"={cfg.eval_fraction})")

    def _list(self) -> list[dict[str, Any]]:
        argv = [self.python, str(BRIDGE), "list", "--env", self.cfg.env]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=self.cfg.list_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise VerifiersEnvError(f"rollout.verifiers.python: {self.python} cannot list {self.cfg.env}: {e}") from e
        if r.returncode != 0:
            tail = r.stderr.strip()[-1500:]
            hint = (" -- verifiers is not installed in that interpreter: run `make verifiers` and set "
                    "rollout.verifiers.python=.venv-vf/bin/python" if "No module named 'verifiers'" in tail else "")
            raise VerifiersEnvError(f"listing {self.cfg.env} with {self.python} failed{hint}:\n{tail}")
        rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        if not rows:
            raise VerifiersEnvError(f"{self.cfg.env}: its taskset has no tasks")
        return rows

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rows = self.rows[split]
        if split == "eval":
            return [copy_task(t) for t in rows[:n]]
        return draw_rows(rows, n, seed)

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        argv = [self.python, str(BRIDGE), "run", "--env", self.cfg.env, "--max-turns", str(self.rollout.max_turns)]
        return CommandAgent(argv, sampling=sampling, timeout_s=self.rollout.agent_timeout_s)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        try:
            result = json.loads((outcome.answer or "").strip().splitlines()[-1]) if outcome else None
        except (ValueError, IndexError):
            result = None
        if not isinstance(result, dict) or "reward" not in result:
            raise VerifiersEnvError(f"episode of {task.task_id}: the bridge printed no rewards")
        return {"outcome": float(result["reward"]), **{k: float(v) for k, v in result["rewards"].items()}}
