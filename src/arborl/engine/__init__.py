"""The built-in PyTorch inference engine (CPU and CUDA)."""

from arborl.engine.async_engine import AsyncEngine, EngineClosedError, EngineError, TokenEvent
from arborl.engine.engine import LLMEngine
from arborl.models.forward import UnsupportedModelError

__all__ = ["AsyncEngine", "EngineClosedError", "EngineError", "LLMEngine", "TokenEvent", "UnsupportedModelError"]
