"""The trainer ranks of ``train.parallel`` as Ray actors in a placement group (``cluster.backend=ray``).

``RayRankGroup`` is ``train.ranks.RankGroup`` with another launcher: one ``RankActor`` per rank, each
in its own bundle of a placement group (``cluster.rank_cpus``, ``cluster.rank_gpus``,
``cluster.placement_strategy``), so Ray may put the ranks on any node of the cluster. Every actor
runs the same rank entry point (``train.ranks.rank_main``) with torchrun's variables: ``MASTER_ADDR``
is rank 0's node, ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` count the ranks on each node. The ranks reach
the trainer at its node's address. An actor is owned by the process that made it (the driver, or
the trainer actor under ``cluster.trainer_restarts``), so it dies with it; ``close`` kills the
actors and removes the placement group.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from torch import nn

from arborl.cluster.session import ClusterError, bundles, placed_group, ray_module, remove_pg, start, stop
from arborl.config import ClusterConfig, TrainConfig
from arborl.train.ranks import RankGroup, free_port, rank_env, rank_main


class RankActor:
    """One trainer rank (a Ray actor): ``info`` before, then ``serve`` runs the rank until it stops."""

    def info(self) -> dict[str, Any]:
        ray = ray_module()
        return {"pid": os.getpid(), "ip": ray.util.get_node_ip_address(), "node": ray.get_runtime_context().get_node_id(),
                "port": free_port()}

    def serve(self, env: dict[str, str]) -> int:
        os.environ.update(env)
        try:
            rank_main()
        except SystemExit as e:  # a failed rank reports its traceback to the trainer, then exits 1
            return int(e.code or 0)
        return 0


class _ActorRank:
    """A rank actor seen as RankGroup sees a rank process: pid, poll(), wait(timeout), returncode, kill()."""

    def __init__(self, actor: Any, ref: Any, pid: int) -> None:
        self.actor, self.ref, self.pid = actor, ref, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ray = ray_module()
            ready, _ = ray.wait([self.ref], timeout=0)
            if ready:
                try:
                    self.returncode = int(ray.get(self.ref))
                except ray.exceptions.RayError:  # the actor died (killed, its node lost)
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = ray_module().wait([self.ref], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"rank actor {self.pid}", timeout or 0)
        return self.poll()  # type: ignore[return-value]

    def kill(self) -> None:
        ray_module().kill(self.actor, no_restart=True)


class RayRankGroup(RankGroup):
    """``cfg.parallel.ranks`` trainer ranks as Ray actors, driven like one trainer (see RankGroup)."""

    def __init__(self, model: nn.Module | Callable[[], nn.Module], cfg: TrainConfig, cluster: ClusterConfig, *,
                 temperature: float = 1.0, start_timeout_s: float = 300.0) -> None:
        from arborl.train.parallel import check_supported

        check_supported(cfg)  # before a Ray session is opened
        self.cluster = cluster
        self.pg = None
        self.actors: list[Any] = []
        self.placement: list[dict[str, Any]] = []  # per rank: its actor's pid, node and torchrun variables
        self._started = start(cluster)
        try:
            self.control_host = ray_module().util.get_node_ip_address()
        except BaseException:
            stop(self._started)
            raise
        super().__init__(model, cfg, temperature=temperature, start_timeout_s=start_timeout_s)

    def _launch(self, control: dict[str, str], timeout: float) -> None:
        ray = ray_module()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c, n = self.cluster, self.world
        bundle = {"CPU": c.rank_cpus, **({"GPU": c.rank_gpus} if c.rank_gpus else {})}
        self.pg = placed_group(c, bundles(bundle, n, c.rank_nodes), "ranks", what="trainer rank",
                               lower="train.parallel.ranks or cluster.rank_cpus / rank_gpus, check cluster.rank_nodes")
        remote_cls = ray.remote(RankActor)
        self.actors = [remote_cls.options(
            num_cpus=c.rank_cpus, num_gpus=c.rank_gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote() for i in range(n)]
        try:
            infos = ray.get([a.info.remote() for a in self.actors], timeout=c.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the trainer rank actors were not ready within cluster.placement_timeout_s="
                               f"{c.placement_timeout_s:g} s") from None
        nodes = list(dict.fromkeys(info["node"] for info in infos))  # in rank order of first appearance
        on_node = {node: [r for r, info in enumerate(infos) if info["node"] == node] for node in nodes}
        for r, (actor, info) in enumerate(zip(self.actors, infos)):
            local = on_node[info["node"]]
            env = {**rank_env(r, n, infos[0]["port"], master_addr=infos[0]["ip"], threads=self.cfg.parallel.threads_per_rank,
                              local_rank=local.index(r), local_world=len(local), node_rank=nodes.index(info["node"])),
                   **control}
            self.placement.append({**info, **{k: v for k, v in env.items() if k not in control}})
            self.procs.append(_ActorRank(actor, actor.serve.remote(env), info["pid"]))

    def close(self, *, force: bool = False, grace_s: float = 10.0) -> None:
        try:
            super().close(force=force, grace_s=grace_s)
        finally:
            ray = ray_module()
            for actor in self.actors:  # a rank that stopped leaves its actor idle
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - Ray already down
                    pass
            self.actors = []
            if self.pg is not None:
                remove_pg(self.pg)
                self.pg = None
            stop(self._started)
            self._started = False
