"""The controller's side of the rollout workers: start N worker processes, hand them episodes,
notice when one dies or stalls, restart it, and fail its episodes as infrastructure failures.

    pool = WorkerPool(2, rollout_cfg, base_url=..., model=..., log_dir=run_dir / "workers")
    await pool.start()
    report = await pool.run({"task": ..., "session_id": ..., "api_key": ..., "sampling": ...})
    await pool.close()

A worker runs many episodes at once (each an asyncio task in it). Its death (a crash, SIGKILL, OOM)
or a stall (no heartbeat for ``stall_s``: an agent blocked the worker's event loop) fails every
episode it held with ``WorkerDiedError`` -- an ``InfraError``, so the controller retries them --
and a fresh worker takes its place. ``RemoteAgent`` is the agent loop that runs an episode this way.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arborl.agents.base import AgentOutcome
from arborl.config import RolloutConfig
from arborl.envs.base import InfraError
from arborl.types import EpisodeStatus, Task

log = logging.getLogger(__name__)


class WorkerDiedError(InfraError):
    """The rollout worker running an episode died or stalled (the episode is retried)."""


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    pending: dict[str, asyncio.Future] = field(default_factory=dict)
    last_beat: float = 0.0
    ready: asyncio.Future | None = None
    reader: asyncio.Task | None = None
    dead: bool = False


class WorkerPool:
    def __init__(self, n: int, rollout: RolloutConfig, *, base_url: str, model: str, stall_s: float = 30.0,
                 start_timeout_s: float = 120.0, log_dir: str | Path | None = None,
                 unix_socket: str | Path | None = None) -> None:
        """``base_url``: the gateway over HTTP; ``unix_socket``: the gateway's Unix socket, bound into the
        sandboxes of sandboxed agents."""
        if n < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.n = n
        self.init = {"kind": "init", "rollout": rollout.model_dump(mode="json"), "base_url": base_url, "model": model,
                     "unix_socket": str(unix_socket) if unix_socket else None}
        self.stall_s = stall_s
        self.start_timeout_s = start_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self.workers: list[_Worker] = []
        self.restarts = 0
        self.deaths = 0
        self._ids = itertools.count()
        self._closing = False
        self._watch: asyncio.Task | None = None
        self._respawns: set[asyncio.Task] = set()

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.workers = list(await asyncio.gather(*(self._spawn(i) for i in range(self.n))))
        self._watch = asyncio.create_task(self._watchdog())

    async def _spawn(self, index: int) -> _Worker:
        stderr: Any = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log_dir / f"worker-{index}.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "arborl.workers.main", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, limit=2**26, start_new_session=True)
        finally:
            if stderr is not None:
                stderr.close()
        w = _Worker(index, proc, last_beat=asyncio.get_running_loop().time())
        w.ready = asyncio.get_running_loop().create_future()
        w.reader = asyncio.create_task(self._read(w))
        self._send(w, self.init)
        try:
            await asyncio.wait_for(asyncio.shield(w.ready), self.start_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._kill(w)
            raise InfraError(f"rollout worker {index} did not start within {self.start_timeout_s} s"
                             + (f" (see {self.log_dir}/worker-{index}.log)" if self.log_dir else "")) from None
        except BaseException:  # cancelled (the pool closing while it restarts one): the new worker goes too
            self._kill(w)
            await w.proc.wait()
            await asyncio.gather(w.reader, return_exceptions=True)
            raise
        return w

    async def close(self) -> None:
        """Stop every worker (their episodes in flight fail) and wait until they are gone."""
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
        respawns = list(self._respawns)
        for t in respawns:
            t.cancel()
        await asyncio.gather(*respawns, return_exceptions=True)  # a worker being started is stopped, not left
        for w in self.workers:
            if w.proc.stdin is not None and not w.proc.stdin.is_closing():
                w.proc.stdin.close()
        for w in self.workers:
            try:
                await asyncio.wait_for(w.proc.wait(), 5)
            except (asyncio.TimeoutError, TimeoutError):
                self._kill(w)
                await w.proc.wait()
            if w.reader is not None:
                await asyncio.gather(w.reader, return_exceptions=True)

    # -- episodes ---------------------------------------------------------------------------------
    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one episode job on the least-loaded live worker; its result message. Raises
        ``WorkerDiedError`` if the worker dies or stalls first."""
        live = [w for w in self.workers if not w.dead]
        while not live and self._respawns and not self._closing:  # every worker is restarting: wait for one
            await asyncio.wait(set(self._respawns), return_when=asyncio.FIRST_COMPLETED)
            live = [w for w in self.workers if not w.dead]
        if self._closing or not live:
            raise WorkerDiedError("no rollout worker is running (the pool is closed, or its workers failed to restart)")
        w = min(live, key=lambda w: len(w.pending))
        job_id = f"job-{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        w.pending[job_id] = fut
        self._send(w, {"kind": "episode", "job_id": job_id, **job})
        try:
            return await fut
        except asyncio.CancelledError:  # the controller gave up (timeout, cancelled group): stop it there too
            if not w.dead:
                self._send(w, {"kind": "cancel", "job_id": job_id})
            raise
        finally:
            w.pending.pop(job_id, None)

    def stats(self) -> dict[str, int]:
        return {"workers": sum(not w.dead for w in self.workers), "worker_deaths": self.deaths,
                "worker_restarts": self.restarts, "in_flight": sum(len(w.pending) for w in self.workers)}

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if not w.dead]

    # -- supervision ------------------------------------------------------------------------------
    def _send(self, w: _Worker, msg: dict[str, Any]) -> None:
        try:
            assert w.proc.stdin is not None
            w.proc.stdin.write((json.dumps(msg, default=str) + "\n").encode())
        except (ConnectionError, RuntimeError, AssertionError):
            pass  # a dead worker: the reader reports it

    async def _read(self, w: _Worker) -> None:
        assert w.proc.stdout is not None
        loop = asyncio.get_running_loop()
        try:
            while line := await w.proc.stdout.readline():
                msg = json.loads(line)
                w.last_beat = loop.time()
                kind = msg.get("kind")
                if kind == "ready" and w.ready is not None and not w.ready.done():
                    w.ready.set_result(msg)
                elif kind == "result":
                    fut = w.pending.get(msg["job_id"])
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except (ValueError, asyncio.LimitOverrunError) as e:
            log.error("rollout worker %d broke the protocol: %r", w.index, e)
            self._kill(w)
        code = await w.proc.wait()
        self._on_death(w, code)

    def _on_death(self, w: _Worker, code: int | None) -> None:
        if w.dead:
            return
        w.dead = True
        if self._closing:
            why = "the pool closed"
        else:
            self.deaths += 1
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            log.warning("rollout worker %d (pid %d) %s; %d episode(s) it held are retried", w.index, w.proc.pid, why,
                        len(w.pending))
        err = WorkerDiedError(f"rollout worker {w.index} (pid {w.proc.pid}) died ({why}) while running this episode")
        for fut in w.pending.values():
            if not fut.done():
                fut.set_exception(err)
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(err)
        if not self._closing and w in self.workers:
            t = asyncio.create_task(self._respawn(w))
            self._respawns.add(t)
            t.add_done_callback(self._respawns.discard)

    async def _respawn(self, old: _Worker) -> None:
        try:
            new = await self._spawn(old.index)
        except InfraError as e:
            log.error("%s", e)
            return
        if self._closing:
            self._kill(new)
            return
        self.workers[self.workers.index(old)] = new
        self.restarts += 1

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.stall_s / 4))
            for w in self.workers:
                started = w.ready is not None and w.ready.done()  # start-up has its own timeout
                if started and not w.dead and loop.time() - w.last_beat > self.stall_s:
                    log.warning("rollout worker %d sent no heartbeat for %.0f s: killing it", w.index, self.stall_s)
                    self._kill(w)

    @staticmethod
    def _kill(w: _Worker) -> None:
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)  # the worker and whatever its agents started
        except (ProcessLookupError, PermissionError):
            pass


class RemoteAgent:
    """The agent loop of one episode run by a rollout worker: ``await RemoteAgent(pool, sampling)(task, client)``.

    ``client`` is the controller's in-process session client; the worker gets the session's id and key
    and calls the gateway over HTTP. Raises ``WorkerDiedError`` when the worker dies."""

    def __init__(self, pool: WorkerPool, sampling: dict[str, Any]) -> None:
        self.pool = pool
        self.sampling = dict(sampling)

    async def __call__(self, task: Task, client: Any) -> AgentOutcome:
        task_json = {"task_id": task.task_id, "prompt": task.prompt, "metadata": task.metadata, "split": task.split}
        res = await self.pool.run({"task": task_json, "session_id": client.session_id, "api_key": client.api_key,
                                   "harness_key": getattr(client, "harness_key", None), "sampling": self.sampling})
        if res.get("infra_error"):
            raise InfraError(res["infra_error"])
        info = dict(res.get("info") or {})
        if res.get("error"):
            info["error"] = res["error"]
            if res.get("traceback"):
                info["traceback"] = res["traceback"]
        return AgentOutcome(answer=res.get("answer"), status=EpisodeStatus(res.get("status", "finished")), info=info)
