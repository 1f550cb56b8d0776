"""The driver's handle on one engine actor, shaped like ``AsyncEngine`` so the engine pool, the
dispatcher and the gateway use it unchanged.

A dead actor (killed, its node lost) fails the requests it held with ``EngineClosedError``: the
dispatcher continues them on the other engines from their tokens, under affinity placement the
gateway answers 503 (retryable) and the episode is retried. Ray restarts the actor (up to
``cluster.max_restarts``); the handle then loads the latest published weights into it and, only
once it serves the current version, reopens it and tells its listeners (the pool's router) that it
is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from arborl.config import EngineConfig
from arborl.engine.face import EngineClosedError, EngineLimits, TokenEvent
from arborl.cluster.collective import MissedBroadcast
from arborl.cluster.weights import WeightPublisher
from arborl.types import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)


def _limits(info: dict[str, Any]) -> EngineLimits:
    cfg = EngineConfig.model_validate(info["config"])
    return EngineLimits(cfg.max_seq_len, cfg.max_batch_size, int(info["vocab_size"]), frozenset(info["eos_token_ids"]))


def _actor_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    return (rex.RayActorError,)


class ActorEngine:
    def __init__(self, actor: Any, info: dict[str, Any], publisher: WeightPublisher, *, max_restarts: int,
                 rejoin_timeout_s: float) -> None:
        self.actor = actor
        self.limits = _limits(info)
        self._spec: dict = dict(info.get("spec_stats") or {})
        self.engine_id: str = info["engine_id"]
        self.pid: int = info["pid"]
        self.device: str = info.get("device", "cpu")
        self.gpu_ids: list[str] = list(info.get("gpu_ids", []))
        self.publisher = publisher
        self.max_restarts = max_restarts
        self.rejoin_timeout_s = rejoin_timeout_s
        self.restarts = 0  # times Ray restarted its actor and it came back
        self.on_rejoin: list[Callable[["ActorEngine"], None]] = []
        self._version: int = info["version"]
        self._incarnation: str = info["incarnation"]
        self._in_flight = 0
        self._down = False  # its actor died; restarting
        self._dead = False  # it will not come back
        self._shut = False
        self._rejoin: threading.Thread | None = None
        self._errors = _actor_errors()

    # -- what the pool reads ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def incarnation(self) -> str:
        """Changes when Ray restarts the actor."""
        return self._incarnation

    @property
    def closed(self) -> bool:
        return self._shut or self._down or self._dead

    @property
    def down(self) -> bool:
        """Its actor died and it has not rejoined (yet)."""
        return self._down or self._dead

    def load(self) -> int:
        return self._in_flight

    def spec_stats(self) -> dict:
        """Speculative-decoding counters as of the last weight update (empty when it is off)."""
        return self._spec

    # -- serving ------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._check()
        self._in_flight += 1
        try:
            return await self._await(self.actor.generate.remote(request))
        except asyncio.CancelledError:
            with contextlib.suppress(EngineClosedError):
                self.abort(request.request_id)
            raise
        finally:
            self._in_flight -= 1

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateResult]:
        async with contextlib.aclosing(self.stream_timed(request)) as events:  # closing early aborts at once
            async for _, ev in events:
                yield ev

    async def stream_timed(self, request: GenerateRequest) -> AsyncIterator[tuple[float, TokenEvent | GenerateResult]]:
        """``stream`` with the wall time each event left the engine (in the actor's process)."""
        self._check()
        self._in_flight += 1
        finished = False
        try:
            gen = self.actor.stream.options(num_returns="streaming").remote(request)
            try:
                async for ref in gen:
                    for t, ev in await ref:
                        finished = finished or isinstance(ev, GenerateResult)
                        yield t, ev
            except self._errors as e:
                raise self._lost(e) from e
        finally:
            self._in_flight -= 1
            if not finished:
                with contextlib.suppress(EngineClosedError):
                    self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self._shut:
            raise EngineClosedError(f"engine {self.engine_id} is shut down")
        if not self.down:  # a dead actor took its requests with it
            self.actor.abort.remote(request_id)

    async def pause(self, after_tokens: int = 0) -> int:
        """The actor's ``AsyncEngine.pause``: returns once it stopped decoding. Cancelling the wait does
        not withdraw it in the actor: the engine still pauses once the count is reached (``resume``
        then)."""
        self._check()
        return await self._await(self.actor.pause.remote(after_tokens))

    def resume(self) -> None:
        self._check()
        self.actor.resume.remote()

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Publish (once for all engines) and load. An engine that is down gets them when it rejoins."""
        payload = await asyncio.to_thread(self.publisher.payload, state, version)
        if self.down:
            return 0.0
        try:
            try:
                secs, self._spec = await self.actor.update_weights.remote(payload, version)
            except MissedBroadcast:  # it rejoined after the version's broadcast: its object-store copy
                latest = await asyncio.to_thread(self.publisher.for_restart)
                assert latest is not None
                secs, self._spec = await self.actor.update_weights.remote(*latest)
                version = latest[1]
        except self._errors as e:
            self._lost(e)
            return 0.0
        self._version = version
        return secs

    async def export_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]:
        self._check()
        return await self._await(self.actor.export_kv.remote(tokens))

    async def import_kv(self, tokens: list[int], kv: torch.Tensor | None, version: int) -> int:
        self._check()
        return await self._await(self.actor.import_kv.remote(tokens, kv, version))

    async def import_kv_from(self, source: "ActorEngine", tokens: list[int]) -> int:
        """Move the KV of ``tokens``' cached prefix from ``source``'s actor straight to this one's, through
        the object store (the driver only sees its version)."""
        source._check()
        self._check()
        kv_ref, version_ref = source.actor.export_kv.options(num_returns=2).remote(tokens)
        version = await source._await(version_ref)  # the source failing is the source's loss, not ours
        return await self._await(self.actor.import_kv.remote(tokens, kv_ref, version))

    async def stats(self) -> dict:
        self._check()
        return await self._await(self.actor.stats.remote())

    async def release_memory(self, weights: bool = False) -> int:
        """The actor's engine frees its idle caches (and with ``weights`` its weights) in the actor's process:
        0 bytes in this one."""
        if not self.down:
            self._check()
            await self._await(self.actor.release_memory.remote(weights) if weights else self.actor.release_memory.remote())
        return 0

    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or Ray itself is down
            pass

    # -- faults -------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.closed:
            state = "shut down" if self._shut else "lost (its actor died)" if self._dead else "restarting"
            raise EngineClosedError(f"engine {self.engine_id} is {state}")

    async def _await(self, ref: Any) -> Any:
        try:
            return await ref
        except self._errors as e:
            raise self._lost(e) from e

    def _lost(self, error: BaseException) -> EngineClosedError:
        """The actor died: close now, and come back (latest weights first) once Ray restarted it."""
        if not self.down and not self._shut:
            self._down = True
            log.warning("engine %s: its actor died (%s); waiting for Ray to restart it", self.engine_id,
                        type(error).__name__)
            if self.restarts >= self.max_restarts:
                self._dead = True
            else:
                self._rejoin = threading.Thread(target=self._come_back, name=f"rejoin-{self.engine_id}", daemon=True)
                self._rejoin.start()
        return EngineClosedError(f"engine {self.engine_id}'s actor died ({type(error).__name__}); retry the call "
                                 "(another engine serves it)")

    def _come_back(self) -> None:
        """In its own thread (no event loop needs to outlive it): wait for Ray's restart, load the latest
        weights, then reopen."""
        import ray

        deadline = time.monotonic() + self.rejoin_timeout_s
        while not self._shut:
            try:
                info = ray.get(self.actor.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
                latest = self.publisher.for_restart()
                if latest is not None and info["version"] != latest[1]:
                    ray.get(self.actor.update_weights.remote(latest[0], latest[1]))
                    info = ray.get(self.actor.info.remote())
                    if self.publisher.latest is not None and info["version"] != self.publisher.latest[1]:
                        continue  # a newer version came out meanwhile
            except Exception as e:  # noqa: BLE001 - still restarting, or a payload retired under us
                if time.monotonic() > deadline:
                    log.error("engine %s did not come back within %.0f s (%r); it stays down", self.engine_id,
                              self.rejoin_timeout_s, e)
                    self._dead = True
                    return
                time.sleep(0.2)
                continue
            if info["incarnation"] != self._incarnation:  # restarted (not merely unreachable for a moment)
                self.restarts += 1
            self._version, self._incarnation, self.pid = info["version"], info["incarnation"], info["pid"]
            self._down = False
            latest = self.publisher.latest  # published while it reopened (the pool skipped it): load it now
            if latest is not None and latest[1] != self._version:
                latest = self.publisher.for_restart()
                try:
                    ray.get(self.actor.update_weights.remote(latest[0], latest[1]))
                    self._version = latest[1]
                except Exception:  # noqa: BLE001 - it died again: the next call notices
                    pass
            log.warning("engine %s is back (restart %d) at version %d", self.engine_id, self.restarts, self._version)
            for fn in self.on_rejoin:
                fn(self)
            return
