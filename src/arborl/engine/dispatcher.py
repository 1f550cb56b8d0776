"""Serving engine requests through a dispatch policy (S5, S6) over several engines.

The engine pool (``engine/pool.py``) places requests this way instead of by session affinity when
``scheduling.dispatch`` names a dispatch policy (``pinned``, ``seer``, ...: anything but ``affinity``). A request is submitted with its
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

An engine that shuts down gets nothing more; a request whose piece was lost with it continues on
another engine from its tokens (unless that piece was already streamed to the caller); with no
engine left, requests fail with ``EngineClosedError``. A dispatcher serves one event loop (the
gateway's); another loop calling it gets a RuntimeError rather than a silent hang.

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

from arborl.engine.face import EngineClosedError, EngineFace, TokenEvent
from arborl.scheduling.partial import continuation, merge
from arborl.scheduling.policies import Assignment, RequestSpec
from arborl.scheduling.timeline import Timeline
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
    complete: bool = False  # ended by itself (stop, its max_tokens, the context), whatever aborts came late
    streamed: int = 0  # tokens handed to a streaming caller

    @property
    def generated(self) -> int:
        return sum(len(p.token_ids) for p in self.pieces)


class Dispatcher:
    """Engine requests through a dispatch policy over ``engines``; see the module docstring."""

    def __init__(self, engines: Sequence[EngineFace], policy, *, migration: str = "transfer") -> None:
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
        self._paused = 0  # weight updates in progress
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = time.monotonic()
        self._tasks: set[asyncio.Task] = set()
        self.counts = {"requests": 0, "pieces": 0, "migrations": 0, "transferred_tokens": 0, "resumed": 0, "rescued": 0}
        self.timeline: Timeline | None = None  # when set, one span per piece (engine, tokens, why it ended)
        self.timeline_t0 = 0.0  # wall time (time.time()) the timeline's clock starts at
        self.step = 0  # trainer step stamped on the spans (the controller sets it)

    def record(self, timeline: Timeline | None, *, t0: float, step: int) -> None:
        """Record pieces into ``timeline`` (None: stop recording), clock from ``t0``, as ``step``."""
        self.timeline, self.timeline_t0, self.step = timeline, t0, step

    def _span(self, live: _Live, ended: str | None = None, tokens: int = 0, *, instance: int = 0, probe: bool = False) -> None:
        if self.timeline is None:
            return
        t = time.time() - self.timeline_t0
        rid = live.request.request_id
        if ended is None:
            self.timeline.start(t, rid, live.group_id, instance, version=self.engines[instance].version, probe=probe,
                                step=self.step)
        else:  # stamped with the step it ends in: the step whose Gantt is written next has it
            self.timeline.end(t, rid, tokens, ended, step=self.step)

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
        if live.engine is not None:  # its piece ends with what it has (or completes: see _piece_done)
            if live.piece_id is not None:
                with contextlib.suppress(EngineClosedError):
                    self.engines[live.engine].abort(live.piece_id)
        else:
            self.policy.cancel(request_id)
            self._finish(live)

    @property
    def version(self) -> int:
        return max(e.version for e in self.engines)

    def live_requests(self) -> tuple[str, ...]:
        """Ids of the requests submitted and not yet ended (queued, or with a piece running), in
        submission order. Read-only."""
        return tuple(self._live)

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
        self._check_loop()
        self._paused += 1
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
            self._paused -= 1
            self._pump()

    # -- internals --------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None or (self._loop is not loop and (self._loop.is_closed() or not self._live)):
            if self._live:  # requests of a loop that is gone: nobody waits for them any more
                for rid in list(self._live):
                    self.policy.cancel(rid)
                    self.policy.forget(rid)
                self._live.clear()
                self._pieces = [0] * len(self.engines)
                self._paused = 0
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("a Dispatcher serves one event loop: call it from the loop that runs the gateway "
                               "(or give each loop its own gateway)")

    def _alive(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if i not in self._down and not e.closed]

    def _submit(self, request: GenerateRequest, group_id: str, *, stream: bool) -> _Live:
        self._check_loop()
        if not self._alive():
            raise EngineClosedError("no engine is serving (all were shut down)")
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
        if eng.closed and i not in self._down:
            self._mark_down(i)
        # our own count: the engine's lags behind a finished piece, and nothing else feeds these engines
        return i not in self._down and self._pieces[i] < eng.limits.max_batch_size

    def _mark_down(self, i: int) -> None:
        """Engine ``i`` shut down: the policy sends nothing more there; with no engine left, every
        queued request fails (a retry gets a clear error)."""
        if i in self._down:
            return
        self._down.add(i)
        self.policy.remove_instance(i)
        if not self._alive():
            err = EngineClosedError("no engine is serving (all were shut down)")
            for live in [x for x in self._live.values() if x.engine is None]:
                self.policy.cancel(live.request.request_id)
                self._fail(live, err)

    def rejoin(self, i: int) -> None:
        """Engine ``i`` came back (a restarted Ray actor at the current version): the policy may place
        pieces there again. Safe from any thread: it runs on the dispatcher's loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                if asyncio.get_running_loop() is loop:
                    self._rejoin(i)
                    return
            except RuntimeError:  # no loop in this thread
                pass
            loop.call_soon_threadsafe(self._rejoin, i)
        else:
            self._rejoin(i)

    def _rejoin(self, i: int) -> None:
        if i not in self._down or self.engines[i].closed:
            return
        self._down.discard(i)
        self.policy.restore_instance(i)
        self._pump()

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
        live = self._live.get(a.request_id)
        if live is None:  # defensive: a request that already ended must not run
            self.policy.cancel(a.request_id)
            self.policy.forget(a.request_id)
            return
        req = live.request
        piece = continuation(req.prompt_token_ids, live.pieces, req.params, request_id=f"{req.request_id}#{len(live.pieces)}",
                             chunk_tokens=a.max_new_tokens, priority=a.priority)
        assert piece is not None, "the policy assigned a request that is complete"
        piece.group_id = live.group_id  # speculative drafts share the group's tokens
        live.engine, live.piece_id = a.instance, piece.request_id
        self._span(live, instance=a.instance, probe=a.probe)
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
                if self.migration == "transfer":
                    await self._transfer(live.home, i, piece.prompt_token_ids)
            if live.aborted or live.preempted:  # stopped while its KV was moving: the engine never saw it
                result = GenerateResult(piece.request_id, piece.prompt_token_ids, [], [], [], [], FinishReason.ABORT)
            elif live.events is None:
                result = await eng.generate(piece)
            else:
                offset = live.generated
                async for ev in eng.stream(piece):
                    if isinstance(ev, TokenEvent):
                        ev.index += offset
                        live.streamed += 1
                        live.events.put_nowait(ev)
                    else:
                        result = ev
        except asyncio.CancelledError:  # the loop is going away: end the request, start nothing new
            self._span(live, "cancel")
            self._pieces[i] -= 1
            live.engine, live.piece_id = None, None
            self.policy.cancel(live.request.request_id)
            self._fail(live, EngineClosedError("the dispatcher's event loop was cancelled"))
            raise
        except Exception as e:  # noqa: BLE001 - one request's failure never stops the others
            error = e
        self._pieces[i] -= 1
        live.engine, live.piece_id = None, None
        try:
            if isinstance(error, EngineClosedError):
                self._mark_down(i)
            if error is not None:
                self._span(live, "cancel")
            if (isinstance(error, EngineClosedError) and self._alive() and not live.aborted
                    and (live.events is None or live.streamed == live.generated)):  # go on elsewhere from its tokens
                self.counts["rescued"] += 1
                live.preempted = False
                self.policy.requeue(live.request.request_id, live.generated, self._now())
            elif error is not None:
                self.policy.cancel(live.request.request_id)
                self._fail(live, error)
            else:
                assert result is not None
                self._piece_done(live, i, piece, result)
        except Exception as e:  # noqa: BLE001 - never leave the caller waiting
            log.exception("dispatching request %s failed", live.request.request_id)
            self._fail(live, e)
        self._pump()

    async def _transfer(self, src: int, dst: int, tokens: list[int]) -> None:
        """Copy the KV of ``tokens``' cached prefix from engine ``src`` to ``dst``; on any trouble the
        piece simply recomputes it."""
        if src in self._down or self.engines[src].closed:
            return
        try:
            kv, version = await self.engines[src].export_kv(tokens)
            if kv is not None:
                self.counts["transferred_tokens"] += await self.engines[dst].import_kv(tokens, kv, version)
        except EngineClosedError:
            if self.engines[src].closed:
                self._mark_down(src)
        except Exception:  # noqa: BLE001
            log.exception("KV transfer from engine %d to %d failed; recomputing", src, dst)

    def _piece_done(self, live: _Live, i: int, piece: GenerateRequest, result: GenerateResult) -> None:
        rid = live.request.request_id
        if result.token_ids or result.finish_reason != FinishReason.ABORT:
            live.pieces.append(result)
            live.home = i
        generated = live.generated
        if live.preempted and not live.aborted and result.finish_reason == FinishReason.ABORT:
            self._span(live, "chunk", len(result.token_ids))
            live.preempted = False
            self.counts["resumed"] += 1
            self.policy.requeue(rid, generated, self._now())
            return
        live.preempted = False
        live.complete = result.finish_reason == FinishReason.STOP or (
            result.finish_reason == FinishReason.LENGTH
            and (
                len(result.token_ids) < piece.params.max_tokens  # the engine's context is full ...
                or len(piece.prompt_token_ids) + len(result.token_ids) >= self.engines[i].limits.max_seq_len
                or generated >= live.request.params.max_tokens
            )
        )
        finished = live.aborted or live.complete
        self._span(live, "finish" if live.complete else "cancel" if finished else "chunk", len(result.token_ids))
        if live.aborted and not live.complete:
            self.policy.cancel(rid)  # its length is not a finished length: no estimate from it
        else:
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
            if live.aborted and not live.complete:
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
        self.policy.cancel(rid)
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
