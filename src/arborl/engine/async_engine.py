"""asyncio front of the engine: the model runs in one worker thread; callers await results.

Every mutation of the engine (add, abort, weight update) is queued and applied by the worker thread
between steps, so the core loop needs no locks. A cancelled ``generate`` aborts its request.
A failing step fails only the requests that were in it; the engine keeps serving.

``pause`` stops decoding between two steps -- at once, or after the step that brings the engine's
generated tokens ``after_tokens`` past the call -- and ``resume`` goes on. A paused engine still
applies every command (adds queue, weight updates load, aborts end their requests at once), so a
caller gets "a request in flight with k tokens" as an event, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable

import torch

from arborl.engine.engine import LLMEngine
from arborl.engine.face import EngineClosedError, EngineError, EngineLimits, RequestFailedError, TokenEvent
from arborl.engine.sequence import Sequence
from arborl.types import GenerateRequest, GenerateResult


log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineClosedError", "EngineError", "TokenEvent"]  # the face's types, re-exported


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._closed = False
        self._pending_calls: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()  # _call()s not yet run
        self._paused = False  # written by the worker thread only
        # pause() calls not yet reached: (caller's loop, its future, generated-token count to pause at)
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, int]] = []
        self._thread = threading.Thread(target=self._loop, name=f"arborl-{engine.engine_id}", daemon=True)
        self._thread.start()

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    # it loads published LoRA adapters (``models.lora``) and serves them on the base it holds
    serves_adapters = True

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def spec_stats(self) -> dict[str, float]:
        return self.engine.spec_stats()

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> int:
        """Requests in flight (waiting + running): what a router balances on."""
        return len(self._futures)

    # -- public API -------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        done, _ = await self._submit(request, stream=False)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateResult]:
        """Yields a TokenEvent per generated token, then the final GenerateResult.
        Closing the iterator early (client gone) aborts the request."""
        done, queue = await self._submit(request, stream=True)
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                ready, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter in ready:
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                yield done.result()
                return
        finally:
            if not done.done():
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._command(lambda: self.engine.abort(request_id))

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Swap weights between two steps; returns seconds spent in the engine thread."""
        return await self._call(lambda: self.engine.update_weights(state, version))

    async def release_memory(self, weights: bool = False) -> int:
        """The engine's prefix cache and spare KV rows (and with ``weights`` its packed weights) freed when it
        is idle (``LLMEngine.release_memory``)."""
        return await self._call(lambda: self.engine.release_memory(weights))

    async def export_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]:
        """KV of the longest cached prefix of ``tokens`` and its policy version (for migration)."""
        return await self._call(lambda: self.engine.export_prefix_kv(tokens))

    async def import_kv(self, tokens: list[int], kv: torch.Tensor | None, version: int) -> int:
        """Cache KV another engine exported; 0 when its version is not this engine's."""
        return await self._call(lambda: self.engine.import_prefix_kv(tokens, kv, version))

    async def stats(self) -> dict:
        return await self._call(lambda: {**self.engine.stats_dict(), "paused": self._paused})

    async def pause(self, after_tokens: int = 0) -> int:
        """Stop decoding between two steps: at once (``after_tokens=0``), or after the first step at
        which the engine has generated ``after_tokens`` more tokens than when the call took effect.
        Returns once paused, with the engine's generated-token count. Commands still apply while
        paused (see the module docstring); ``resume`` goes on. Waits as long as the engine has not
        generated that many tokens (use ``asyncio.wait_for`` to bound it)."""
        if after_tokens < 0:
            raise ValueError(f"after_tokens must be >= 0, got {after_tokens}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def arm() -> None:
            self._pause_waiters.append((loop, fut, self.engine.stats.generated_tokens + after_tokens))
            self._check_pause()

        self._command(arm)
        return await fut

    def resume(self) -> None:
        """Decode again after ``pause`` (applied after every command queued before it)."""
        def go() -> None:
            self._paused = False

        self._command(go)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # -- plumbing ---------------------------------------------------------------------------------
    async def _submit(self, request: GenerateRequest, *, stream: bool):
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()

        def on_token(seq: Sequence) -> None:
            i = len(seq.output) - 1
            ev = TokenEvent(seq.output[i], seq.logprobs[i], seq.sample_logprobs[i], seq.versions[i], i)
            _deliver(loop, queue.put_nowait, ev)

        def add() -> None:
            self.engine.add_request(request, on_token if stream else None)  # raises on invalid input
            self._futures[request.request_id] = (loop, done)

        try:
            await self._call(add)
        except asyncio.CancelledError:  # the add may still run: make sure the request ends at once
            self.abort(request.request_id)
            raise
        return done, queue

    def _command(self, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise EngineClosedError("engine is shut down")
            self._commands.append(fn)
            self._cond.notify_all()

    async def _call(self, fn):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        entry = (loop, fut)
        self._pending_calls.add(entry)

        def run() -> None:
            self._pending_calls.discard(entry)
            try:
                value = fn()
            except Exception as e:
                _deliver(loop, _set_exception, fut, e)
            else:
                _deliver(loop, _set_result, fut, value)

        try:
            self._command(run)
        except EngineClosedError:
            self._pending_calls.discard(entry)
            raise
        return await fut

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._commands and (self._paused or not self.engine.has_work):
                    self._cond.wait()
                if self._closed:
                    break
                commands, self._commands = self._commands, []
            for fn in commands:
                try:
                    fn()
                except Exception:  # a command reports its own errors (see _call); never kill the loop
                    log.exception("engine command failed")
            if self._paused:
                for res in self.engine.reap_aborts():
                    self._resolve(res.request_id, res, None)
                continue
            if not self.engine.has_work:
                continue
            try:
                results = self.engine.step()
            except Exception as e:  # fail what was in flight, keep serving
                self._fail_in_flight(e)
                continue
            for res in results:
                self._resolve(res.request_id, res, None)
            for request_id, why in self.engine.take_failed():
                self._resolve(request_id, None, RequestFailedError(why))
            self._check_pause()
        self._fail_in_flight(EngineClosedError("engine is shut down"))
        for loop, fut, _ in self._pause_waiters:
            _deliver(loop, _set_exception, fut, EngineClosedError("engine is shut down"))
        self._pause_waiters.clear()
        for loop, fut in list(self._pending_calls):  # queued calls that will never run
            _deliver(loop, _set_exception, fut, EngineClosedError("engine is shut down"))
        self._pending_calls.clear()

    def _check_pause(self) -> None:
        """Worker thread, between steps: pause when the armed token count is reached."""
        generated = self.engine.stats.generated_tokens
        self._pause_waiters = [w for w in self._pause_waiters if not w[1].cancelled()]  # callers gone
        reached = [w for w in self._pause_waiters if w[2] <= generated]
        if not reached:
            return
        self._paused = True
        self._pause_waiters = [w for w in self._pause_waiters if w[2] > generated]
        for loop, fut, _ in reached:
            _deliver(loop, _set_result, fut, generated)

    def _resolve(self, request_id: str, result: GenerateResult | None, error: Exception | None) -> None:
        entry = self._futures.pop(request_id, None)
        if entry is None:
            return
        loop, fut = entry
        if error is None:
            _deliver(loop, _set_result, fut, result)
        else:
            _deliver(loop, _set_exception, fut, error)

    def _fail_in_flight(self, cause: Exception) -> None:
        err = cause if isinstance(cause, EngineError) else EngineError(f"engine step failed: {cause!r}")
        self.engine.drop_all()
        for rid in list(self._futures):
            self._resolve(rid, None, err)


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Hand a value to a caller's loop; a caller whose loop is gone is dropped, never the engine."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # event loop is closed
        pass


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)
