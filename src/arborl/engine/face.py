"""The engine's face: what every engine shows the engine pool, the dispatcher, the gateway and PD.

One protocol for every engine -- the built-in ``AsyncEngine``, an external server (vLLM, SGLang:
``backends/remote.ServerEngine``), a Ray engine actor seen from the driver
(``cluster/remote.ActorEngine``) -- with its limits (:class:`EngineLimits`), the token event it
streams, the errors it raises, and the stop rules every engine applies the same way
(:class:`StopRules`). Consumers are typed against :class:`EngineFace` and never import a concrete
engine class.

:class:`RequestFace` is the part a single gateway request talks to; the dispatcher's per-group front
has only that part, an engine has all of :class:`EngineFace`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from arborl.types import ArborlError, FinishReason, GenerateRequest, GenerateResult, InvalidRequestError, SamplingParams


class EngineError(ArborlError, RuntimeError):
    """The engine failed while serving a request (the request is lost, the engine is not)."""


class EngineClosedError(EngineError):
    """The engine was shut down."""


class WeightsReleasedError(EngineError):
    """The engine released its weights (``release_memory(weights=True)``) and serves nothing until the next
    weight update."""


class RequestFailedError(EngineError):
    """This request failed inside an engine step (e.g. its logits were not finite); the other requests
    of the step went on."""


@dataclass
class TokenEvent:
    token_id: int
    logprob: float
    sample_logprob: float
    version: int
    index: int  # position in the completion


@dataclass(frozen=True)
class EngineLimits:
    """What an engine accepts: the pool and the dispatcher size and check requests by these."""

    max_seq_len: int
    max_batch_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]

    def check(self, request: GenerateRequest, *, can_decode: bool) -> None:
        """Raise ``InvalidRequestError`` naming what to fix when this engine cannot serve ``request``
        (``can_decode``: the engine has a tokenizer, which stop strings need)."""
        request.validate(self.vocab_size, self.max_seq_len)
        if request.params.stop and not can_decode:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)")


@dataclass(frozen=True)
class StopRules:
    """When a sequence stops, the same in every engine: EOS (unless ignored) or a stop token id, a stop
    string on the decoded tail (a continuation's earlier pieces included), ``max_tokens``, or the
    engine's ``max_seq_len``. ``decode`` turns token ids into text (needed only for stop strings)."""

    eos_token_ids: frozenset[int]
    max_seq_len: int
    decode: Callable[[Sequence[int]], str] | None = None

    def reason(self, request: GenerateRequest, output: Sequence[int], tok: int) -> FinishReason | None:
        """Why the request stops after ``tok`` (the last of ``output``, its generated tokens), or None."""
        p = request.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self.hit_stop_string(request, output):
            return FinishReason.STOP
        if len(output) >= p.max_tokens or len(request.prompt_token_ids) + len(output) >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def hit_stop_string(self, request: GenerateRequest, output: Sequence[int]) -> bool:
        stops = request.params.stop
        if self.decode is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        window = max(len(s) for s in stops) + 4  # tokens: every token decodes to >= 0 chars
        toks = list(request.prompt_token_ids) + list(output)
        start = len(request.prompt_token_ids) - request.continued  # a continuation's earlier pieces count
        tail = self.decode(toks[max(start, len(toks) - window):])
        return any(s in tail for s in stops)

    def stop_token_ids(self, params: SamplingParams) -> list[int]:
        """The ids that end generation for ``params`` (EOS unless ignored, then the request's own)."""
        return list(dict.fromkeys(([] if params.ignore_eos else sorted(self.eos_token_ids)) + list(params.stop_token_ids)))


@runtime_checkable
class RequestFace(Protocol):
    """What one gateway request talks to: one engine, or the dispatcher on behalf of a group."""

    engine_id: str

    @property
    def version(self) -> int: ...

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateResult]: ...

    def abort(self, request_id: str) -> None: ...


@runtime_checkable
class EngineFace(RequestFace, Protocol):
    """One engine serving one policy. It takes token ids and returns token ids with, per token, the raw
    (temperature-1) and the sampling log-probability and the policy version that produced it; it aborts,
    honours stop token ids and stop strings, per-request seeds, continues a request from its tokens
    (``GenerateRequest.continued``), loads new weights as a new version, and reports its health."""

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def closed(self) -> bool: ...

    def load(self) -> int:
        """Requests in flight: what a router balances on."""
        ...

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> float: ...

    async def release_memory(self, weights: bool = False) -> int:
        """Told that no request comes until the next weight update (a synchronous run's training): free what
        serves requests and is rebuilt on demand -- the prefix cache, the KV rows beyond the first -- where
        nothing runs or waits. ``weights``: the next update carries every weight (a full fine-tuning warm
        start), so an engine may free its own copy of them too and refuse requests until that update
        (``WeightsReleasedError``); one that cannot, frees what it can. Returns the bytes freed in this process
        (0 for an engine in another one)."""
        ...

    async def export_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]: ...

    async def import_kv(self, tokens: list[int], kv: torch.Tensor | None, version: int) -> int: ...

    def spec_stats(self) -> dict[str, float]:
        """arborl's speculative-decoding counters ({} when off or not run by arborl)."""
        ...

    async def stats(self) -> dict: ...

    def shutdown(self) -> None: ...
