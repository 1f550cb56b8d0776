"""Building the serving side from a config: model, engine replicas in an engine pool, the run's data
pool and the gateway over them (what ``arborl train``, ``arborl serve``, ``arborl eval`` and the
benchmarks run on)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from arborl.config import Config
from arborl.datapool import DataPool
from arborl.engine import LLMEngine
from arborl.engine.async_engine import AsyncEngine
from arborl.engine.pool import EnginePool
from arborl.gateway.core import Gateway
from arborl.models import LoadedModel, load_model


@dataclass
class Assembled:
    gateway: Gateway
    engines: EnginePool
    pool: DataPool
    loaded: LoadedModel

    def close(self) -> None:
        self.engines.shutdown()
        self.pool.close()


def build_gateway(
    cfg: Config, *, loaded: LoadedModel | None = None, run_dir: str | Path | None = None, version: int = 0
) -> Assembled:
    """Load the model (unless given), start ``gateway.num_engines`` engines (engine-0, engine-1, ...,
    each with its own copy of the weights) in a pool placed by the scheduling knobs, open the run's
    data pool, and wire the gateway."""
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
    pool = EnginePool.from_config(engines, cfg.scheduling, affinity_max_load=cfg.gateway.affinity_max_load)
    datapool = DataPool.from_config(run_dir if run_dir is not None else cfg.run_dir, cfg.datapool)
    gateway = Gateway(pool, datapool=datapool, tokenizer=loaded.tokenizer, model_name=loaded.name, config=cfg.gateway)
    return Assembled(gateway, pool, datapool, loaded)
