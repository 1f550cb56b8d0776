"""Rollout workers as Ray actors (``cluster.backend=ray`` with ``rollout.workers > 0``).

``RayWorkerPool`` has ``WorkerPool``'s interface (``start``, ``run``, ``close``, ``stats``, ``pids``),
so ``RemoteAgent`` and the controller use it unchanged. Each worker is a ``WorkerActor`` -- the same
episode loop as ``python -m arborl.workers.main`` -- in a placement-group bundle of
``cluster.worker_cpus`` CPUs; it reaches the gateway over HTTP as a worker process does.

A worker that dies (killed, OOM, its node lost) fails the episodes it held with ``WorkerDiedError``
(an infrastructure failure: retried, never trained on) and Ray restarts it (up to
``cluster.max_restarts``); one whose event loop stalls (no answer to a heartbeat within
``rollout.worker_stall_s``) is killed and restarted the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any

from arborl.cluster.session import ClusterError, bundles, pg_name, ray_module, remove_pg
from arborl.config import ClusterConfig, RolloutConfig
from arborl.workers.pool import WorkerDiedError

log = logging.getLogger(__name__)


class _Result:
    """Stands in for the worker process's stdout: keeps the one result message of an episode."""

    def __init__(self) -> None:
        self.msg: dict[str, Any] = {}

    def send(self, **msg: Any) -> None:
        self.msg = msg


class WorkerActor:
    """Wrapped with ``ray.remote`` by the pool; runs episodes on its event loop, many at once."""

    def __init__(self, init: dict[str, Any]) -> None:
        self.init = init
        self.ctx: dict[str, Any] | None = None

    async def _context(self) -> dict[str, Any]:
        if self.ctx is None:  # the HTTP client belongs to the actor's event loop
            import httpx

            from arborl.agents import AGENTS
            from arborl.tasks import make_suite

            rollout = RolloutConfig.model_validate(self.init["rollout"])
            self.ctx = {"base_url": self.init["base_url"], "model": self.init["model"], "unix_socket": self.init["unix_socket"],
                        "http": httpx.AsyncClient(timeout=None), "suite": make_suite(rollout),
                        "factory": AGENTS.get(rollout.agent)}
        return self.ctx

    async def ready(self) -> int:
        await self._context()
        return os.getpid()

    async def beat(self) -> int:
        return os.getpid()

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        from arborl.workers.main import _episode

        out = _Result()
        await _episode(job, await self._context(), out)  # a cancel from the pool ends it as "aborted"
        return out.msg


class RayWorkerPool:
    def __init__(self, n: int, rollout: RolloutConfig, cluster: ClusterConfig, *, base_url: str, model: str,
                 stall_s: float = 30.0, unix_socket: str | None = None) -> None:
        if n < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.n = n
        self.cluster = cluster
        self.init = {"rollout": rollout.model_dump(mode="json"), "base_url": base_url, "model": model,
                     "unix_socket": str(unix_socket) if unix_socket else None}
        self.stall_s = stall_s
        self.actors: list[Any] = []
        self._pids: list[int | None] = []
        self._pending: list[int] = []
        self._down: set[int] = set()
        self.deaths = 0
        self.restarts = 0
        self.pg = None
        self._ids = itertools.count()
        self._closing = False
        self._watch: asyncio.Task | None = None
        self._rejoins: dict[int, asyncio.Task] = {}

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        ray = ray_module()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.cluster
        options: dict[str, Any] = {"num_cpus": c.worker_cpus, "max_restarts": c.max_restarts, "max_task_retries": 0,
                                   "max_concurrency": 10000}
        if c.worker_cpus > 0 or c.worker_nodes:
            self.pg = placement_group(bundles({"CPU": c.worker_cpus} if c.worker_cpus > 0 else {}, self.n, c.worker_nodes),
                                      strategy=c.placement_strategy, name=pg_name("workers"))
            try:
                await asyncio.wait_for(self.pg.ready(), c.placement_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                self._remove_pg()
                raise ClusterError(
                    f"the placement group of {self.n} rollout-worker bundles of cluster.worker_cpus={c.worker_cpus:g} "
                    f"was not placed within cluster.placement_timeout_s={c.placement_timeout_s:g} s; the cluster has "
                    f"{ray.available_resources()} free: lower rollout.workers or cluster.worker_cpus, check cluster.worker_nodes, or add nodes") from None
        remote_cls = ray.remote(WorkerActor)
        self.actors = [remote_cls.options(
            **options, **({"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)}
                          if self.pg is not None else {})).remote(self.init) for i in range(self.n)]
        self._pending = [0] * self.n
        try:
            self._pids = list(await asyncio.wait_for(asyncio.gather(*(a.ready.remote() for a in self.actors)),
                                                     c.placement_timeout_s))
        except BaseException:
            await self.close()
            raise
        self._watch = asyncio.create_task(self._watchdog())

    async def close(self) -> None:
        self._closing = True
        for t in [self._watch, *self._rejoins.values()]:
            if t is not None:
                t.cancel()
        ray = ray_module()
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone, or Ray is down
                pass
        self._remove_pg()

    def _remove_pg(self) -> None:
        if self.pg is not None:
            remove_pg(self.pg)
            self.pg = None

    # -- episodes ---------------------------------------------------------------------------------
    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one episode on the least-loaded live worker; raises ``WorkerDiedError`` if it dies first."""
        live = [i for i in range(len(self.actors)) if i not in self._down]
        while not live and self._rejoins and not self._closing:  # every worker is restarting: wait for one
            await asyncio.wait(set(self._rejoins.values()), return_when=asyncio.FIRST_COMPLETED)
            live = [i for i in range(len(self.actors)) if i not in self._down]
        if self._closing or not live:
            raise WorkerDiedError("no rollout worker is running (the pool is closed, or its workers failed to restart)")
        i = min(live, key=lambda i: self._pending[i])
        job = {"job_id": f"job-{next(self._ids)}", **job}
        ray = ray_module()
        ref = self.actors[i].run.remote(job)
        self._pending[i] += 1
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            raise self._died(i, e) from None
        except asyncio.CancelledError:  # the controller gave up: stop it in the worker too
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - the worker is gone already
                pass
            raise
        finally:
            self._pending[i] -= 1

    def stats(self) -> dict[str, int]:
        return {"workers": len(self.actors) - len(self._down), "worker_deaths": self.deaths,
                "worker_restarts": self.restarts, "in_flight": sum(self._pending)}

    def pids(self) -> list[int]:
        return [p for i, p in enumerate(self._pids) if i not in self._down and p is not None]

    # -- supervision ------------------------------------------------------------------------------
    def _died(self, i: int, error: BaseException) -> WorkerDiedError:
        if i not in self._down and not self._closing:
            self._down.add(i)
            self.deaths += 1
            log.warning("rollout worker %d (pid %s) died (%s); the episodes it held are retried", i, self._pids[i],
                        type(error).__name__)
            self._rejoins[i] = asyncio.create_task(self._rejoin(i))
        return WorkerDiedError(f"rollout worker {i} (pid {self._pids[i]}) died ({type(error).__name__}) while "
                               "running this episode")

    async def _rejoin(self, i: int) -> None:
        """Wait for Ray to restart the actor, then send it episodes again."""
        try:
            deadline = asyncio.get_running_loop().time() + self.cluster.placement_timeout_s
            while not self._closing:
                try:
                    pid = await asyncio.wait_for(self.actors[i].ready.remote(), 5)
                except Exception:  # noqa: BLE001 - still restarting
                    if asyncio.get_running_loop().time() > deadline:
                        log.error("rollout worker %d did not come back; it stays down", i)
                        return
                    await asyncio.sleep(0.2)
                    continue
                if pid != self._pids[i]:
                    self.restarts += 1
                self._pids[i] = pid
                self._down.discard(i)
                return
        finally:
            self._rejoins.pop(i, None)

    async def _watchdog(self) -> None:
        ray = ray_module()
        while True:
            await asyncio.sleep(min(1.0, self.stall_s / 4))
            for i, a in enumerate(self.actors):
                if i in self._down:
                    continue
                try:
                    await asyncio.wait_for(a.beat.remote(), self.stall_s)
                except (asyncio.TimeoutError, TimeoutError):
                    log.warning("rollout worker %d answered no heartbeat for %.0f s: killing it", i, self.stall_s)
                    ray.kill(a, no_restart=False)  # Ray restarts it; its episodes fail and are retried
                except ray.exceptions.RayActorError as e:
                    self._died(i, e)
