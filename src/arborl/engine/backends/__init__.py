"""Engine backends: what serves the policy behind the engine pool (docs/backends.md).

``ENGINE_BACKENDS`` maps ``engine.backend`` to a factory ``f(cfg, loaded, *, index, version) ->
EngineFace``: ``builtin`` (arborl's own engine, in process), ``vllm`` (vLLM's server, supervised)
and ``sglang`` (SGLang's server, CUDA only). The pool, the dispatcher and the gateway use every one
the same way, through ``engine/face.EngineFace``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from arborl.engine.async_engine import AsyncEngine
from arborl.engine.backends.base import BackendError, ServerUnavailableError
from arborl.engine.engine import LLMEngine
from arborl.engine.face import EngineFace
from arborl.engine.specdec.mtp import mtp_init_path
from arborl.models.quantize import to_serving_dtype
from arborl.registry import Registry

if TYPE_CHECKING:
    from arborl.config import Config
    from arborl.models import LoadedModel

ENGINE_BACKENDS: Registry = Registry("engine backend")


def engine_id(cfg: "Config", index: int) -> str:
    return f"{cfg.engine.engine_id.rsplit('-', 1)[0]}-{index}"


@ENGINE_BACKENDS.register("builtin")
def builtin(cfg: "Config", loaded: "LoadedModel", *, index: int = 0, version: int = 0) -> AsyncEngine:
    """arborl's engine in this process; engine 0 serves ``loaded.model``, the others a copy each."""
    model = loaded.model if index == 0 else copy.deepcopy(loaded.model)
    model = to_serving_dtype(model, cfg.engine.weights_dtype)  # low-precision rollout (I5); trainer's stays
    ecfg = cfg.engine.model_copy(update={"engine_id": engine_id(cfg, index)})
    if ecfg.spec.enabled and ecfg.spec.drafter == "mtp":  # the head beside an HF policy directory, if any
        ecfg.spec = ecfg.spec.model_copy(update={"mtp_path": mtp_init_path(cfg)})
    eng = LLMEngine(model, ecfg, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer, seed=cfg.seed + index,
                    version=version, owns_model=loaded.exclusive or index > 0)
    return AsyncEngine(eng)


@ENGINE_BACKENDS.register("vllm")
def vllm(cfg: "Config", loaded: "LoadedModel", *, index: int = 0, version: int = 0) -> EngineFace:
    """vLLM's OpenAI-compatible server on a copy of ``loaded.model`` written to disk (engine.vllm)."""
    from arborl.engine.backends.vllm import VLLMEngine

    return VLLMEngine(cfg, loaded, index=index, version=version)


@ENGINE_BACKENDS.register("sglang")
def sglang(cfg: "Config", loaded: "LoadedModel", *, index: int = 0, version: int = 0) -> EngineFace:
    """SGLang's server on a copy of ``loaded.model`` written to disk (engine.sglang); CUDA only."""
    from arborl.engine.backends.sglang import SGLangEngine

    return SGLangEngine(cfg, loaded, index=index, version=version)


def build_engines(cfg: "Config", loaded: "LoadedModel", *, version: int = 0) -> list[EngineFace]:
    """``gateway.num_engines`` engines of ``engine.backend``; the ones started are shut down if a later one fails."""
    factory = ENGINE_BACKENDS.get(cfg.engine.backend)
    engines: list = []
    try:
        # the last first: engines 1.. copy loaded.model before engine 0 takes it (and, owning it, frees what its
        # packed weights replace)
        for i in reversed(range(cfg.gateway.num_engines)):
            engines.append(factory(cfg, loaded, index=i, version=version))
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
    return engines[::-1]


__all__ = ["ENGINE_BACKENDS", "BackendError", "ServerUnavailableError", "build_engines"]
