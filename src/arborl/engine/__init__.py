"""The built-in PyTorch inference engine (CPU and CUDA)."""

from arborl.engine.async_engine import AsyncEngine
from arborl.engine.face import (EngineClosedError, EngineError, EngineFace, EngineLimits, RequestFailedError, TokenEvent,
                                WeightsReleasedError)
from arborl.engine.engine import LLMEngine
from arborl.models.forward import UnsupportedModelError

__all__ = ["AsyncEngine", "EngineClosedError", "EngineError", "EngineFace", "EngineLimits", "LLMEngine", "RequestFailedError",
           "TokenEvent", "UnsupportedModelError", "WeightsReleasedError"]
