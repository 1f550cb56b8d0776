"""Engine replicas as Ray actors in a placement group (``cluster.backend=ray``).

Every engine gets one bundle of ``cluster.engine_cpus`` CPUs and ``cluster.engine_gpus`` GPUs; the
placement group must be ready within ``cluster.placement_timeout_s`` or the run stops with what the
cluster has, instead of hanging. The policy model goes to the object store once and every actor
builds its engine from that copy. Rollout workers are actors too (``workers.py``); the trainer, the
gateway and its data pool run in the driver, or in a trainer actor (``supervise.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any

from arborl.cluster.actor import EngineActor
from arborl.cluster.remote import ActorEngine
from arborl.cluster.session import ClusterError, bundles, placed_group, ray_module, remove_pg, start, stop
from arborl.cluster.weights import WEIGHT_SYNC, WeightPublisher
from arborl.config import Config


def engine_bundle(cfg: Config) -> dict[str, float]:
    c = cfg.cluster
    return {k: v for k, v in (("CPU", c.engine_cpus), ("GPU", c.engine_gpus)) if v > 0}


def make_publisher(cfg: Config, run_dir: str | Path | None = None) -> WeightPublisher:
    """The ``cluster.weight_sync`` method; safetensors files go to ``cluster.shared_dir`` (default
    ``<run_dir>/weights``)."""
    c = cfg.cluster
    directory = Path(c.shared_dir) if c.shared_dir else Path(run_dir if run_dir is not None else cfg.run_dir) / "weights"
    return WeightPublisher(WEIGHT_SYNC.get(c.weight_sync)(directory))


class RayDeployment:
    """``gateway.num_engines`` engine actors and their handles (``engines``); ``close`` removes them,
    the placement group, published weights and (when it started it) the Ray session."""

    def __init__(self, cfg: Config, loaded: Any, *, version: int = 0, run_dir: str | Path | None = None) -> None:
        t0 = time.perf_counter()
        c = cfg.cluster
        self.cfg = cfg
        self.engines: list[ActorEngine] = []
        self.pg = None
        self._loaded_ref = None  # kept alive: Ray rebuilds a restarted actor from it
        self.publisher = make_publisher(cfg, run_dir)
        self._started = start(c)
        try:
            self._place(cfg, loaded, version)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0

    def _place(self, cfg: Config, loaded: Any, version: int) -> None:
        ray = ray_module()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c, n = cfg.cluster, cfg.gateway.num_engines
        self.pg = placed_group(c, bundles(engine_bundle(cfg), n, c.engine_nodes), "engines", what="engine",
                               lower="gateway.num_engines or cluster.engine_cpus / engine_gpus, check cluster.engine_nodes")
        # one copy of the policy in the object store, every actor builds its engine from it
        self._loaded_ref = loaded_ref = ray.put(dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).cpu()))
        remote_cls = ray.remote(EngineActor)
        device = cfg.model.device if c.engine_gpus > 0 else None
        cfg_json = cfg.model_dump(mode="json")
        actors = [remote_cls.options(
            num_cpus=c.engine_cpus, num_gpus=c.engine_gpus, max_restarts=c.max_restarts, max_task_retries=0,
            max_concurrency=1000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(cfg_json, loaded_ref, index=i, version=version, threads=int(c.engine_cpus), device=device)
            for i in range(n)]
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=c.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise ClusterError(f"the engine actors were not ready within cluster.placement_timeout_s="
                               f"{c.placement_timeout_s:g} s") from None
        self.engines = [ActorEngine(a, info, self.publisher, max_restarts=c.max_restarts,
                                     rejoin_timeout_s=c.placement_timeout_s) for a, info in zip(actors, infos)]
        self.use_sync(self.publisher.sync)

    def use_sync(self, sync: Any) -> None:
        """Publish the next versions with ``sync`` (a ``cluster.weight_sync`` method); a collective one
        learns the engines it broadcasts to."""
        if hasattr(sync, "attach"):
            sync.attach(self.engines)
            sync.timeout_s = self.cfg.cluster.placement_timeout_s
        self.publisher.sync = sync

    def attach(self, pool: Any) -> None:
        """A restarted engine that rejoined is routed to again: by the affinity router, and by the
        dispatcher under any dispatch policy (scheduling.dispatch other than affinity)."""
        for i, served in enumerate(pool.engines):
            e = getattr(served, "decode", served)  # a PD engine rejoins with its decode actor
            if not isinstance(e, ActorEngine):
                continue
            e.on_rejoin.append(lambda _e, i=i: pool.router.down.discard(i))
            if pool.dispatcher is not None:
                e.on_rejoin.append(lambda _e, i=i: pool.dispatcher.rejoin(i))

    def close(self) -> None:
        try:
            for e in self.engines:
                e.shutdown()
            if self.pg is not None:
                remove_pg(self.pg)
                self.pg = None
            self.publisher.close()
        finally:
            stop(self._started)
            self._started = False
