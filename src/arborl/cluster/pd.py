"""Prefill/decode disaggregation (I6) for the built-in engine.

A :class:`PDEngine` is an engine-shaped handle over a *decode* engine fed by a *prefill* engine: a
request's prompt is first prefilled on the prefill engine (a one-token request whose KV stays in
that engine's radix cache), the prompt's KV is exported from there and imported into the decode
engine's radix cache, and the request is then served on the decode engine, which finds all but the
prompt's last token cached. Long multi-turn prompts are then computed beside the decode batch,
not inside its steps. Both sides keep their radix caches (a turn's prompt extends the previous
turn's, so the prefill engine only computes the new tokens).

When the prefill side cannot help (it is down, at another policy version, or fails) the decode
engine simply prefills the prompt itself: the output is the same, only slower.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import torch

from arborl.engine.face import EngineFace, EngineLimits, TokenEvent
from arborl.types import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)


class _Prefiller:
    """One prefill engine shared by several decode engines; weights load once per version."""

    def __init__(self, engine: EngineFace) -> None:
        self.engine = engine
        self.lock = asyncio.Lock()
        self.counts = {"prefills": 0, "moved_tokens": 0, "fallbacks": 0}

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        async with self.lock:
            if self.engine.version != version and not self.engine.closed:
                await self.engine.update_weights(state, version)


class PDEngine:
    """``decode`` serves every request; ``prefill`` computes its prompt's KV first (see module doc)."""

    def __init__(self, prefill: _Prefiller, decode: EngineFace) -> None:
        self.prefiller = prefill
        self.decode = decode
        self.engine_id: str = decode.engine_id

    @property
    def limits(self) -> EngineLimits:
        return self.decode.limits

    def spec_stats(self) -> dict[str, float]:
        return self.decode.spec_stats()

    @property
    def version(self) -> int:
        return self.decode.version

    @property
    def closed(self) -> bool:
        return self.decode.closed

    def load(self) -> int:
        return self.decode.load()

    async def prefill(self, request: GenerateRequest) -> int:
        """Compute ``request``'s prompt KV on the prefill engine and move it to the decode engine;
        returns the prompt tokens the decode engine now holds (0: it prefills them itself)."""
        pre, p = self.prefiller.engine, self.prefiller
        prompt = request.prompt_token_ids
        if pre.closed or pre.version != self.decode.version or len(prompt) < 2:
            p.counts["fallbacks"] += 1
            return 0
        try:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            await pre.generate(GenerateRequest(list(prompt), params, request_id=f"{request.request_id}#prefill"))
            if type(pre) is type(self.decode) and hasattr(self.decode, "import_kv_from"):  # actor to actor
                moved = await self.decode.import_kv_from(pre, prompt)
            else:
                kv, version = await pre.export_kv(prompt)
                moved = 0 if kv is None else await self.decode.import_kv(prompt, kv, version)
        except Exception as e:  # noqa: BLE001 - the decode engine can always prefill by itself
            log.warning("prefill of %s on %s failed (%r); the decode engine prefills it", request.request_id,
                        pre.engine_id, e)
            p.counts["fallbacks"] += 1
            return 0
        p.counts["prefills"] += 1
        p.counts["moved_tokens"] += moved
        return moved

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self.prefill(request)
        return await self.decode.generate(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateResult]:
        await self.prefill(request)
        async for ev in self.decode.stream(request):
            yield ev

    def abort(self, request_id: str) -> None:
        self.decode.abort(request_id)

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        await self.prefiller.update_weights(state, version)
        return await self.decode.update_weights(state, version)

    async def release_memory(self, weights: bool = False) -> int:
        async with self.prefiller.lock:
            freed = await (self.prefiller.engine.release_memory(weights=True) if weights
                           else self.prefiller.engine.release_memory())
        return freed + await (self.decode.release_memory(weights=True) if weights else self.decode.release_memory())

    async def export_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]:
        return await self.decode.export_kv(tokens)

    async def import_kv(self, tokens: list[int], kv: torch.Tensor | None, version: int) -> int:
        return await self.decode.import_kv(tokens, kv, version)

    async def stats(self) -> dict:
        out = dict(await self.decode.stats())
        out.update({f"pd_{k}": v for k, v in self.prefiller.counts.items()})
        return out

    def shutdown(self) -> None:
        self.decode.shutdown()
        self.prefiller.engine.shutdown()


def disaggregate(engines: Sequence[EngineFace], prefill_engines: int) -> list[EngineFace]:
    """The engines the pool places requests on: ``engines`` unchanged when ``prefill_engines`` is 0,
    else the last ones as decode engines, each fed by one of the first ``prefill_engines`` (round robin)."""
    from arborl.config import ConfigError

    if prefill_engines == 0:
        return list(engines)
    if prefill_engines >= len(engines):
        raise ConfigError(f"cluster.pd_prefill_engines={prefill_engines} leaves no decode engine out of "
                          f"gateway.num_engines={len(engines)}: use fewer prefill engines or more engines")
    prefillers = [_Prefiller(e) for e in engines[:prefill_engines]]
    return [PDEngine(prefillers[i % len(prefillers)], e) for i, e in enumerate(engines[prefill_engines:])]


__all__ = ["PDEngine", "disaggregate"]
