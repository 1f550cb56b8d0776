"""The engine actor: one built-in engine (``LLMEngine`` behind its ``AsyncEngine``) in its own Ray
worker process. Its methods are the ``AsyncEngine`` interface; a stream is an async generator whose
items are *batches* of token events (everything generated since the last item), so a fast engine
costs one Ray message per batch, not per token."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from typing import Any, AsyncIterator

import torch

from arborl.config import Config
from arborl.engine.async_engine import TokenEvent
from arborl.engine.backends import ENGINE_BACKENDS
from arborl.cluster.collective import ActorSide, CollectivePayload, Layout
from arborl.cluster.weights import load_payload
from arborl.types import GenerateRequest, GenerateResult


def _gpu_ids() -> list[str]:
    """The physical GPUs Ray gave this actor."""
    import ray

    return [str(i) for i in ray.get_gpu_ids()]


class EngineActor:
    """Wrapped with ``ray.remote`` by the deployment (``cluster/deploy.py``); a plain class here so the
    module imports without Ray. The engine inside is built by the ``engine.backend`` factory of
    ``engine.backends.ENGINE_BACKENDS``, exactly as in-process engines are."""

    def __init__(self, cfg: dict[str, Any], loaded: Any, *, index: int, version: int, threads: int,
                 device: str | None = None) -> None:
        config = Config.model_validate(cfg)
        if not config.engine.num_threads:
            torch.set_num_threads(max(1, threads))
        if device is not None:
            loaded = dataclasses.replace(loaded, model=loaded.model.to(device))
        self.incarnation = uuid.uuid4().hex  # a restarted actor has a new one
        self.collective = ActorSide()  # cluster.weight_sync=collective
        self.device = str(next(loaded.model.parameters()).device)
        self.engine = ENGINE_BACKENDS.get(config.engine.backend)(config, loaded, index=index, version=version)
        self.engine_config = config.engine.model_copy(update={"engine_id": self.engine.engine_id})

    async def info(self) -> dict[str, Any]:
        eng, limits = self.engine, self.engine.limits
        return {"engine_id": eng.engine_id, "version": eng.version, "incarnation": self.incarnation, "pid": os.getpid(),
                "vocab_size": limits.vocab_size, "eos_token_ids": sorted(limits.eos_token_ids),
                "config": self.engine_config.model_dump(mode="json"), "spec_stats": eng.spec_stats(),
                "device": self.device, "gpu_ids": _gpu_ids()}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.engine.generate(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[list[tuple[float, TokenEvent | GenerateResult]]]:
        """Batches of (wall time it came out of the engine, event): the times let a caller see the
        engine's decode-step gaps, which batching hides."""
        events: asyncio.Queue = asyncio.Queue()  # timed token events, the result, then None

        async def pump() -> None:
            try:
                async for ev in self.engine.stream(request):
                    events.put_nowait((time.time(), ev))
            finally:
                events.put_nowait(None)

        task = asyncio.ensure_future(pump())
        try:
            ended = False
            while not ended:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                ended = batch[-1] is None
                batch = [ev for ev in batch if ev is not None]
                if batch:
                    yield batch
        finally:
            if not task.done():
                self.engine.abort(request.request_id)
            await task  # re-raises an engine error into the caller's stream

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def pause(self, after_tokens: int = 0) -> int:
        """``AsyncEngine.pause``: stop decoding (at once or after ``after_tokens`` more tokens)."""
        return await self.engine.pause(after_tokens)

    async def resume(self) -> None:
        self.engine.resume()

    async def update_weights(self, payload: Any, version: int) -> tuple[float, dict]:
        """Load a published version; returns (seconds in the engine, its speculative-decoding counters)."""
        if isinstance(payload, CollectivePayload):
            held = self.collective.holds(payload.version) or payload.ref is None
            fetched = None if held else load_payload(await payload.ref)  # not in the broadcast: the object-store copy
            state = await asyncio.to_thread(self.collective.take, payload, fetched)
        elif isinstance(payload, dict):  # object-store arrays: zero-copy views, not worth a thread hop
            state = load_payload(payload)
        else:  # a safetensors file: disk reads off the event loop
            state = await asyncio.to_thread(load_payload, payload)
        secs = await self.engine.update_weights(state, version)
        return secs, self.engine.spec_stats()

    async def join_collective(self, backend: str, host: str, port: int, epoch: int, rank: int, world: int,
                              timeout_s: float) -> None:
        """Join the driver's weight-broadcast group ``epoch`` (``cluster.weight_sync=collective``)."""
        await asyncio.to_thread(self.collective.join, backend, host, port, epoch, rank, world, timeout_s)

    async def receive_weights(self, epoch: int, version: int, layout: Layout) -> None:
        """Receive ``version`` from the driver's broadcast; ``update_weights`` then loads it."""
        await asyncio.to_thread(self.collective.receive, epoch, version, layout, self.device)

    async def export_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]:
        return await self.engine.export_kv(tokens)

    async def import_kv(self, tokens: list[int], kv: torch.Tensor | None, version: int) -> int:
        return await self.engine.import_kv(tokens, kv, version)

    async def release_memory(self, weights: bool = False) -> int:
        return await self.engine.release_memory(weights)

    async def stats(self) -> dict:
        return await self.engine.stats()

    async def load(self) -> int:
        return self.engine.load()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)
