"""What an engine backend is: the engine-shaped object the engine pool, the dispatcher and the gateway
hold (``AsyncEngine`` is the built-in one), and the errors an external server raises.

A backend takes token ids and returns token ids with, per token, the raw (temperature-1) and the
sampling log-probability and the policy version that produced it (``GenerateResult``); it aborts,
honours stop token ids and stop strings, per-request seeds, continues a request from its tokens
(``GenerateRequest.continued``), loads new weights as a new version, and reports its health.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from arborl.config import EngineConfig
from arborl.engine.async_engine import EngineError, TokenEvent
from arborl.types import GenerateRequest, GenerateResult


@runtime_checkable
class EngineBackend(Protocol):
    """One engine serving one policy. ``engine`` exposes ``config`` (``EngineConfig``: ``max_seq_len``,
    ``max_batch_size``), ``eos_token_ids`` and ``runner.vocab_size``, what the pool and the dispatcher read."""

    engine_id: str
    engine: object

    @property
    def version(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def load(self) -> int: ...

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateResult]: ...

    def abort(self, request_id: str) -> None: ...

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> float: ...

    async def export_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]: ...

    async def import_kv(self, tokens: list[int], kv: torch.Tensor | None, version: int) -> int: ...

    async def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


class BackendError(EngineError):
    """An external inference server failed; the message says what to fix."""


class ServerUnavailableError(BackendError):
    """The server died or is restarting: the request is lost, a retry is served once it is back."""


@dataclass
class _Runner:
    vocab_size: int


@dataclass
class EngineFacts:
    """The fields of the built-in ``LLMEngine`` the pool and the dispatcher read (``config``,
    ``eos_token_ids``, ``runner.vocab_size``, ``spec_stats()``), for a backend that has no such engine in
    this process (an external server)."""

    config: EngineConfig
    eos_token_ids: list[int]
    vocab_size: int
    runner: _Runner = field(init=False)

    def __post_init__(self) -> None:
        self.runner = _Runner(self.vocab_size)

    def spec_stats(self) -> dict[str, float]:
        """arborl's own speculative decoding does not run in an external server (see its own options)."""
        return {}
