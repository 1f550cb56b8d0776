"""Serving engine requests through a dispatch policy (S5, S6) over several engines.

The gateway takes this path instead of its session-affinity router when ``scheduling.dispatch`` is
``seer`` (or ``scheduling.partial_rollout`` is ``abort_resume``). A request is submitted with its
group (the session's GRPO group); it waits in the policy's queue until the policy hands it to an
engine with room; that engine serves one *piece* of it (at most the assignment's new tokens: a Seer
chunk, or the rest of the request), then the request comes back to the policy, which may send its
next piece to another engine. A piece is an ordinary engine request continuing from prompt + the
tokens so far (``partial.continuation``): on the same engine the radix prefix cache makes its
prefill nearly free; on another one its KV is copied over from the engine that holds it
(``scheduling.migration = transfer``) or recomputed. The caller sees one request: ``merge`` joins
the pieces (tokens, log-probs, the policy version of every token), and a stream yields the pieces'
tokens in order.

Weight updates: ``updating(abort_resume=...)`` wraps the engines' update. With ``abort_resume`` the
pieces in flight are aborted before the new weights load and go back to the queue; they resume
under the new policy (partial rollout, abort and resume). Without it they continue on their engine,
which recomputes their KV and stamps later tokens with the new version.

The decisions (which request, where, how many tokens) are the policy's alone: the same classes the
simulator drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from arborl.engine import AsyncEngine, EngineClosedError, TokenEvent
from arborl.rollout.partial import continuation, merge
from arborl.rollout.policies import Assignment, RequestSpec
from arborl.types import FinishReason, GenerateRequest, GenerateResult

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Live:
    request: GenerateRequest
    group_id: str
    done: asyncio.Future
    events: asyncio.Queue | None  # streaming: TokenEvents, then None after the last piece
    pieces: list[GenerateResult] = field(default_factory=list)
    engine: int | None = None  # where the running piece is
    home: int | None = None  # engine that holds its KV from its last piece
    piece_id: str | None = None
    aborted: bool = False
    preempted: bool = False  # aborted for a weight update: goes back to the queue

    @property
    def generated(self) -> int:
        return sum(len(p.token_ids) for p in self.pieces)


class Dispatcher:
    """Engine requests through a dispatch policy over ``engines``; see the module docstring."""

    def __init__(self, engines: Sequence[AsyncEngine], policy, *, migration: str = "transfer") -> None:
        if not engines:
            raise ValueError("a dispatcher needs at least one engine")
        if migration not in ("transfer", "recompute"):
            raise ValueError(f"migration must be transfer or recompute, got {migration!r}")
        self.engines = list(engines)
        self.policy = policy
        self.migration = migration
        self._live: dict[str, _Live] = {}
        self._pieces = [0] * len(self.engines)  # pieces in flight per engine
        self._down: set[int] = set()
        self._paused = False
        self._t0 = time.monotonic()
        self._tasks: set[asyncio.Task] = set()
        self.counts = {"requests": 0, "pieces": 0, "migrations": 0, "transferred_tokens": 0, "resumed": 0}

    # -- the caller's side ------------------------------------------------------------------------
    def front(self, group_id: str) -> "DispatchedEngine":
        """An engine-shaped handle whose requests belong to ``group_id``."""
        return DispatchedEngine(self, group_id)

    async def generate(self, request: GenerateRequest, group_id: str) -> GenerateResult:
        live = self._submit(request, group_id, stream=False)
        try:
            return await asyncio.shield(live.done)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    async def stream(self, request: GenerateRequest, group_id: str) -> AsyncIterator[TokenEvent | GenerateResult]:
        """A TokenEvent per token (index = position in the whole completion), then the merged result."""
        live = self._submit(request, group_id, stream=True)
        assert live.events is not None
        try:
            while (ev := await live.events.get()) is not None:
                yield ev
            yield await live.done
        finally:
            if not live.done.done():
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request: queued, it ends now; running, its piece is aborted and it ends with what it
        has (finish_reason abort)."""
        live = self._live.get(request_id)
        if live is None or live.done.done():
            return
        live.aborted = True
        if self.policy.cancel(request_id):
            if live.engine is not None and live.piece_id is not None:
                with contextlib.suppress(EngineClosedError):
                    self.engines[live.engine].abort(live.piece_id)
        elif live.engine is None:
            self._finish(live)

    def cancel_group(self, group_id: str) -> None:
        for rid in [r for r, live in self._live.items() if live.group_id == group_id]:
            self.abort(rid)

    @property
    def version(self) -> int:
        return max(e.version for e in self.engines)

    def load(self) -> int:
        return len(self._live)

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        out.update({f"policy_{k}": v for k, v in self.policy.stats().items()})
        out["queued"] = float(self.policy.pending())
        out["in_flight_pieces"] = float(sum(self._pieces))
        return out

    @contextlib.asynccontextmanager
    async def updating(self, *, abort_resume: bool):
        """Wrap a weight update of every engine. ``abort_resume``: pieces in flight are aborted first
        and resume from their tokens, under the new weights, once the update is done."""
        self._paused = True
        try:
            if abort_resume:
                waiting = []
                for live in self._live.values():
                    if live.engine is not None and live.piece_id is not None and not live.aborted:
                        live.preempted = True
                        waiting.append(live)
                        with contextlib.suppress(EngineClosedError):
                            self.engines[live.engine].abort(live.piece_id)
                while any(live.engine is not None for live in waiting):
                    await asyncio.sleep(0.005)
            yield
        finally:
            self._paused = False
            self._pump()

    async def close(self) -> None:
        for rid in list(self._live):
            self.abort(rid)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- internals --------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _submit(self, request: GenerateRequest, group_id: str, *, stream: bool) -> _Live:
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        loop = asyncio.get_running_loop()
        live = _Live(request, group_id or request.request_id, loop.create_future(), asyncio.Queue() if stream else None)
        self._live[request.request_id] = live
        self.counts["requests"] += 1
        self.policy.submit(RequestSpec(request.request_id, live.group_id, request.params.max_tokens), self._now())
        self._pump()
        return live

    def _room(self, i: int) -> bool:
        eng = self.engines[i]
        # our own count: the engine's lags behind a finished piece, and nothing else feeds these engines
        return i not in self._down and not eng.closed and self._pieces[i] < eng.engine.config.max_batch_size

    def _pump(self) -> None:
        if self._paused:
            return
        try:
            self._assign_all()
        except Exception as e:  # a policy bug must fail the waiting requests loudly, not leave them hanging
            log.exception("dispatch policy failed")
            for live in [x for x in self._live.values() if x.engine is None]:
                self._fail(live, e)

    def _assign_all(self) -> None:
        n = len(self.engines)
        while self.policy.pending():
            progressed = False
            for i in sorted(range(n), key=lambda i: (self._pieces[i], i)):  # least loaded engine asks first
                if not self._room(i):
                    continue
                a = self.policy.next_for(i, self._now())
                if a is None:
                    continue
                self._launch(a)
                progressed = True
            if not progressed:
                return

    def _launch(self, a: Assignment) -> None:
        live = self._live[a.request_id]
        req = live.request
        piece = continuation(req.prompt_token_ids, live.pieces, req.params, request_id=f"{req.request_id}#{len(live.pieces)}",
                             chunk_tokens=a.max_new_tokens, priority=a.priority)
        assert piece is not None, "the policy assigned a request that is complete"
        live.engine, live.piece_id = a.instance, piece.request_id
        self._pieces[a.instance] += 1
        self.counts["pieces"] += 1
        task = asyncio.ensure_future(self._serve(live, a.instance, piece))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, live: _Live, i: int, piece: GenerateRequest) -> None:
        eng = self.engines[i]
        result: GenerateResult | None = None
        error: BaseException | None = None
        try:
            if live.home is not None and live.home != i:
                self.counts["migrations"] += 1
                if self.migration == "transfer" and live.home not in self._down:
                    kv, version = await self.engines[live.home].export_kv(piece.prompt_token_ids)
                    if kv is not None:
                        self.counts["transferred_tokens"] += await eng.import_kv(piece.prompt_token_ids, kv, version)
            if live.aborted or live.preempted:  # stopped while its KV was moving: the engine never saw it
                result = GenerateResult(piece.request_id, piece.prompt_token_ids, [], [], [], [], FinishReason.ABORT)
            elif live.events is None:
                result = await eng.generate(piece)
            else:
                offset = live.generated
                async for ev in eng.stream(piece):
                    if isinstance(ev, TokenEvent):
                        ev.index += offset
                        live.events.put_nowait(ev)
                    else:
                        result = ev
        except asyncio.CancelledError:
            error = EngineClosedError("the dispatcher was closed")
        except Exception as e:  # noqa: BLE001 - one request's failure never stops the others
            error = e
            if isinstance(e, EngineClosedError):
                self._down.add(i)
        finally:
            self._pieces[i] -= 1
            live.engine, live.piece_id = None, None
        try:
            if error is not None:
                self.policy.cancel(live.request.request_id)
                self._fail(live, error)
            else:
                assert result is not None
                self._piece_done(live, i, piece, result)
        except Exception as e:  # noqa: BLE001 - never leave the caller waiting
            log.exception("dispatching request %s failed", live.request.request_id)
            self._fail(live, e)
        self._pump()

    def _piece_done(self, live: _Live, i: int, piece: GenerateRequest, result: GenerateResult) -> None:
        rid = live.request.request_id
        if result.token_ids or result.finish_reason != FinishReason.ABORT:
            live.pieces.append(result)
            live.home = i
        generated = live.generated
        if live.preempted and not live.aborted and result.finish_reason == FinishReason.ABORT:
            live.preempted = False
            self.counts["resumed"] += 1
            self.policy.requeue(rid, generated, self._now())
            return
        live.preempted = False
        finished = (
            live.aborted
            or result.finish_reason != FinishReason.LENGTH
            or len(result.token_ids) < piece.params.max_tokens  # the engine's context is full ...
            or len(piece.prompt_token_ids) + len(result.token_ids) >= self.engines[i].engine.config.max_seq_len  # ... now
            or generated >= live.request.params.max_tokens
        )
        self.policy.on_chunk_done(rid, generated, finished, self._now())
        if finished:
            self._finish(live)

    def _finish(self, live: _Live) -> None:
        req = live.request
        rid = req.request_id
        self._live.pop(rid, None)
        self.policy.forget(rid)
        if live.pieces:
            res = merge(req.prompt_token_ids, live.pieces)
            res.request_id = rid
            if live.aborted:
                res.finish_reason = FinishReason.ABORT
        else:
            res = GenerateResult(rid, list(req.prompt_token_ids), [], [], [], [], FinishReason.ABORT)
        if live.events is not None:
            live.events.put_nowait(None)
        if not live.done.done():
            live.done.set_result(res)

    def _fail(self, live: _Live, error: BaseException) -> None:
        rid = live.request.request_id
        self._live.pop(rid, None)
        self.policy.forget(rid)
        if live.events is not None:
            live.events.put_nowait(None)
        if not live.done.done():
            live.done.set_exception(error)
            live.done.exception()  # retrieved here: a caller that went away leaves no warning


class DispatchedEngine:
    """What the gateway calls instead of one engine: requests of one group, through the dispatcher."""

    def __init__(self, dispatcher: Dispatcher, group_id: str) -> None:
        self.dispatcher = dispatcher
        self.group_id = group_id
        self.engine_id = "dispatch"

    @property
    def version(self) -> int:
        return self.dispatcher.version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.dispatcher.generate(request, self.group_id)

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateResult]:
        return self.dispatcher.stream(request, self.group_id)

    def abort(self, request_id: str) -> None:
        self.dispatcher.abort(request_id)
