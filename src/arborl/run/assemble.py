"""Building a run's parts from a config: the serving side (model, engine replicas in an engine pool, the
run's data pool and the gateway over them: what ``arborl train``, ``arborl serve``, ``arborl eval`` and
the benchmarks run on) and the trainer of the kind the config names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arborl.cluster import disaggregate
from arborl.cluster.deploy import RayDeployment
from arborl.config import ClusterConfig, Config, TrainConfig
from arborl.datapool import DataPool
from arborl.engine.backends import build_engines
from arborl.engine.pool import EnginePool
from arborl.gateway.core import Gateway
from arborl.models import LoadedModel, load_model
from arborl.train.face import TrainerFace


@dataclass
class Assembled:
    gateway: Gateway
    engines: EnginePool
    pool: DataPool
    loaded: LoadedModel
    cluster: Any = None  # the Ray deployment (cluster.backend=ray), closed last

    def close(self) -> None:
        try:
            self.engines.shutdown()
            self.pool.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()


def build_gateway(
    cfg: Config, *, loaded: LoadedModel | None = None, run_dir: str | Path | None = None, version: int = 0
) -> Assembled:
    """Load the model (unless given), start ``gateway.num_engines`` engines (engine-0, engine-1, ...,
    each with its own copy of the weights) in a pool placed by the scheduling knobs, open the run's
    data pool, and wire the gateway."""
    loaded = loaded or dataclasses.replace(load_model(cfg.model), exclusive=True)  # the engines' alone
    cluster = RayDeployment(cfg, loaded, version=version, run_dir=run_dir) if cfg.cluster.backend == "ray" else None
    engines = cluster.engines if cluster else build_engines(cfg, loaded, version=version)  # engine.backend: builtin, vllm, ...
    try:
        engines = disaggregate(engines, cfg.cluster.pd_prefill_engines)  # prefill/decode instances (cluster.pd_prefill_engines)
    except BaseException:
        for e in engines:
            e.shutdown()
        if cluster:
            cluster.close()
        raise
    pool = EnginePool.from_config(engines, cfg.scheduling, affinity_max_load=cfg.gateway.affinity_max_load)
    if cluster:
        cluster.attach(pool)
    datapool = DataPool.from_config(run_dir if run_dir is not None else cfg.run_dir, cfg.datapool)
    gateway = Gateway(pool, datapool=datapool, tokenizer=loaded.tokenizer, model_name=loaded.name, config=cfg.gateway,
                      trust_agent_rewards=cfg.rollout.trust_agent_rewards)
    return Assembled(gateway, pool, datapool, loaded, cluster)


def trainer_class(train: TrainConfig, cluster: ClusterConfig | None = None) -> type:
    """The kind of trainer the config names: one process (``train.parallel.strategy=none``), ranks as
    subprocesses (ddp / fsdp2), or ranks as Ray actors (those with ``cluster.backend=ray``)."""
    if train.parallel.strategy == "none":
        from arborl.train.trainer import Trainer

        return Trainer
    if cluster is not None and cluster.backend == "ray":
        from arborl.cluster.rank_actors import RayRankGroup

        return RayRankGroup
    from arborl.train.ranks import RankGroup

    return RankGroup


def make_trainer(model: Any, train: TrainConfig, cluster: ClusterConfig | None = None, *,
                 temperature: float = 1.0) -> TrainerFace:
    """The run's trainer, of the kind ``trainer_class`` picks; ``model``: the policy module."""
    kind = trainer_class(train, cluster)
    if cluster is not None and cluster.backend == "ray" and train.parallel.strategy != "none":
        return kind(model, train, cluster, temperature=temperature)
    return kind(model, train, temperature=temperature)
