"""The ``verifiers`` task suite (X1): a verifiers (0.4, ``verifiers.v1``) environment (``rollout.task=verifiers``,
knobs ``rollout.verifiers.*``).

The environment runs in the interpreter it is installed in (``rollout.verifiers.python``; ``make verifiers``
makes ``.venv-vf``) through ``verifiers_bridge.py``, which imports nothing of arborl: its dependency pins
never meet arborl's. The suite lists the taskset once (``bridge list``) and splits it by a hash of each
task's key (``rollout.verifiers.eval_fraction``, the same split every run). Episodes go to one long-lived
``bridge serve`` process (the environment loads once; importing verifiers costs seconds), many at once:
each request names the task and the episode's gateway session, served over HTTP on the job's loop as for
any black-box agent. verifiers runs the environment as it always does -- its ``Env.run`` with the
multi-turn environment responses, its rewards, ``finalize`` -- and every model turn reaches the gateway,
so each token is recorded and trained. The job stops the process with the suite (``shutdown``). The
score: ``outcome`` is verifiers' episode reward (the weighted sum of its rewards; success is outcome
>= 1), and each reward's score is a component under its own name (``train.advantage.shaping.
component_weights`` can weigh them).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborl.agents import AgentLoop, AgentOutcome, SessionClient
from arborl.agents.served import serve_http
from arborl.config import ConfigError
from arborl.tasks.dataset import copy_task, draw_rows
from arborl.types import Call, EpisodeStatus, Task

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
        self.bridge: BridgeProcess | None = None
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
        if self.bridge is None:
            self.bridge = BridgeProcess([self.python, str(BRIDGE), "serve", "--env", self.cfg.env, "--max-turns",
                                         str(self.rollout.max_turns)])
        return VerifiersEpisode(self.bridge, sampling)

    def shutdown(self) -> None:
        """Stop the bridge process (it is started again if another episode comes)."""
        if self.bridge is not None:
            self.bridge.close()

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        result = outcome.info.get("verifiers") if outcome is not None else None
        if not isinstance(result, dict) or "reward" not in result:
            raise VerifiersEnvError(f"episode of {task.task_id}: the bridge gave no rewards")
        return {"outcome": float(result["reward"]), **{k: float(v) for k, v in result["rewards"].items()}}


class BridgeProcess:
    """The ``bridge serve`` process: requests written as JSON lines, answers read by a thread and handed to
    the waiting episode's event loop; started on the first request (again after ``close``)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.next_id = 0
        self.stderr = None

    def _start(self) -> subprocess.Popen:
        self.stderr = tempfile.TemporaryFile()
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                text=True, bufsize=1)
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                waiting = self.pending.pop(msg.get("id"), None)
            if waiting is not None:
                loop, fut = waiting
                loop.call_soon_threadsafe(_settle, fut, msg)
        proc.wait()
        with self.lock:
            left, self.pending = self.pending, {}
        tail = self._stderr_tail()
        for loop, fut in left.values():
            loop.call_soon_threadsafe(_settle, fut, {"error": f"the verifiers bridge exited ({proc.returncode}): {tail}"})

    def _stderr_tail(self) -> str:
        if self.stderr is None:
            return ""
        try:
            self.stderr.seek(0, 2)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - 1500))
            return self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    async def episode(self, request: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            self.next_id += 1
            rid = self.next_id
            self.pending[rid] = (loop, fut)
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"id": rid, **request}) + "\n")
            self.proc.stdin.flush()
        msg = await fut
        if "error" in msg:
            raise VerifiersEnvError(msg["error"])
        return msg["result"]

    def close(self) -> None:
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _settle(fut: asyncio.Future, msg: dict[str, Any]) -> None:
    if not fut.done():
        fut.set_result(msg)


class VerifiersEpisode:
    """An AgentLoop: the bridge runs the episode against this session, served over HTTP meanwhile."""

    def __init__(self, bridge: BridgeProcess, sampling: dict[str, Any]) -> None:
        self.bridge = bridge
        self.sampling = dict(sampling)

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome:
        async with serve_http(client.gateway) as base_url:
            result = await self.bridge.episode({"idx": task.metadata["idx"], "base_url": base_url,
                                                "api_key": client.api_key, "model": client.model,
                                                "sampling": self.sampling})
        status = EpisodeStatus.FINISHED if result.get("ok") else EpisodeStatus.FAILED
        return AgentOutcome(answer=json.dumps({k: result.get(k) for k in ("reward", "rewards")}), status=status,
                            info={"verifiers": result})
