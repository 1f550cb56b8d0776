"""Building a gateway from a config: model, engine replicas, data pool (what ``arborl serve`` runs)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from arborl.config import Config, SchedulingConfig
from arborl.datapool import DataPool
from arborl.engine import AsyncEngine, LLMEngine
from arborl.gateway.core import Gateway
from arborl.models import LoadedModel, load_model
from arborl.rollout.dispatcher import Dispatcher
from arborl.rollout.seer import make_dispatch


@dataclass
class Launched:
    gateway: Gateway
    engines: list[AsyncEngine]
    pool: DataPool
    loaded: LoadedModel

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
        self.pool.close()


def build_gateway(
    cfg: Config, *, loaded: LoadedModel | None = None, run_dir: str | Path | None = None, version: int = 0
) -> Launched:
    """Load the model (unless given), start ``gateway.num_engines`` engines (engine-0, engine-1, ...,
    each with its own copy of the weights), open the run's data pool, and wire the gateway."""
    loaded = loaded or load_model(cfg.model)
    engines = []
    for i in range(cfg.gateway.num_engines):
        model = loaded.model if i == 0 else copy.deepcopy(loaded.model)
        ecfg = cfg.engine.model_copy(update={"engine_id": f"{cfg.engine.engine_id.rsplit('-', 1)[0]}-{i}"})
        eng = LLMEngine(
            model, ecfg, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer, seed=cfg.seed + i,
            version=version,
        )
        engines.append(AsyncEngine(eng))
    pool = DataPool.from_config(run_dir if run_dir is not None else cfg.run_dir, cfg.datapool)
    gateway = Gateway(engines, datapool=pool, tokenizer=loaded.tokenizer, model_name=loaded.name, config=cfg.gateway,
                      dispatcher=make_dispatcher(cfg.scheduling, engines))
    return Launched(gateway, engines, pool, loaded)


def make_dispatcher(sched: SchedulingConfig, engines: list[AsyncEngine]) -> Dispatcher | None:
    """The gateway's dispatcher when the scheduling knobs need one (Seer dispatch, or abort-and-resume
    partial rollout); None: the session-affinity router places requests."""
    if sched.dispatch != "seer" and sched.partial_rollout != "abort_resume":
        return None
    policy = make_dispatch(sched.dispatch, len(engines), chunk_tokens=sched.chunk_tokens,
                           context_aware=sched.context_aware, starvation_s=sched.starvation_s or float("inf"))
    return Dispatcher(engines, policy, migration=sched.migration)
