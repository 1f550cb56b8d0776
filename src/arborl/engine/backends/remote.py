"""An engine whose model runs in an external inference server (vLLM, SGLang), behind the same calls as
the built-in ``AsyncEngine``.

A request is served as one or more *segments*: server requests continuing from the prompt plus the
tokens received so far. Every token is stamped with the policy version of the segment that produced
it. A weight update first stops every segment in flight (closing its stream aborts it in the server),
loads the new weights, resets the server's prefix cache, and lets the requests continue from their
tokens as new segments under the new version: no token is ever stamped with a version that did not
produce it. Tokens count only once they reach us, so what the client sees is what is recorded.

Stop strings are matched here, on the decoded tail as the built-in engine does (a continuation's
earlier pieces included, ``GenerateRequest.continued``); EOS and stop token ids are sent as the
server's stop token ids, so arborl's EOS ids decide, not the server's defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import torch

from arborl.config import EngineConfig
from arborl.engine.backends.base import BackendError, ServerUnavailableError
from arborl.engine.face import EngineClosedError, EngineLimits, StopRules, TokenEvent
from arborl.engine.backends.server import ServerProcess
from arborl.seeding import derive_seed
from arborl.types import FinishReason, GenerateRequest, GenerateResult, InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


class _NotConnected(Exception):
    """The connection failed before the segment produced a token: safe to send again."""


@dataclass
class Segment:
    """What one server request asks: generate from ``tokens`` at most ``max_tokens`` more."""

    request_id: str
    tokens: list[int]
    max_tokens: int
    params: SamplingParams
    stop_token_ids: list[int]
    seed: int | None


@dataclass
class Piece:
    """Tokens a server sent in one stream chunk, with their log-probs, and its finish reason."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    cached_tokens: int | None = None


@dataclass(eq=False)
class _Live:
    request: GenerateRequest
    queue: asyncio.Queue | None
    submitted: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sample_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    aborted: bool = False
    segments: int = 0
    cached: int = 0
    first_token: float | None = None
    task: asyncio.Task | None = None  # the segment reading from the server now


class ServerEngine(ABC):
    """An engine backed by a supervised server. Subclasses say how to start it (``argv``), how to
    stream one segment (``stream_segment``) and how to load weights from a directory (``load_weights``)."""

    kind = "remote"

    def __init__(self, config: EngineConfig, *, eos_token_ids: list[int], vocab_size: int, tokenizer,
                 version: int, logprobs_kind: str) -> None:
        self.engine_id = config.engine_id
        self.config = config
        self.limits = EngineLimits(config.max_seq_len, config.max_batch_size, int(vocab_size), frozenset(eos_token_ids))
        self.tokenizer = tokenizer
        decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self.stop_rules = StopRules(self.limits.eos_token_ids, config.max_seq_len, decode)
        self.logprobs_kind = logprobs_kind  # "sample" or "raw": which one the server's log-probs are
        self._version = version
        self._closed = False
        self._updating = False  # segments are stopped for a weight load
        self._update_in_progress = False
        self._live: dict[str, _Live] = {}
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self.server: ServerProcess | None = None
        self.counts = {"requests": 0, "segments": 0, "generated_tokens": 0, "aborted": 0, "weight_updates": 0,
                       "inexact_logprob_tokens": 0, "failed_requests": 0}
        self.weight_update_s: list[float] = []  # seconds of each update (write + load + cache reset)
        self.weight_load_s: list[float] = []  # of which the server's own load + cache reset

    # -- what subclasses provide ------------------------------------------------------------------
    @property
    @abstractmethod
    def url(self) -> str: ...

    @abstractmethod
    def stream_segment(self, client: httpx.AsyncClient, seg: Segment) -> AsyncIterator[Piece]: ...

    async def prepare_weights(self, state: dict[str, torch.Tensor], version: int) -> object:
        """Work done while requests still run (e.g. writing the weights to disk); its result goes to
        ``load_weights``."""
        return state

    @abstractmethod
    async def load_weights(self, client: httpx.AsyncClient, prepared: object, version: int) -> None:
        """Make the server serve the prepared weights (no segment is in flight while this runs)."""

    # -- the engine's face ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    def load(self) -> int:
        return len(self._live)

    def spec_stats(self) -> dict[str, float]:
        """arborl's own speculative decoding does not run in an external server (see its own options)."""
        return {}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        live = self._admit(request, stream=False)
        return await self._run(live)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateResult]:
        """A TokenEvent per token, then the GenerateResult; closing the iterator early aborts the request."""
        live = self._admit(request, stream=True)
        assert live.queue is not None
        runner = asyncio.ensure_future(self._run(live))
        try:
            while True:
                getter = asyncio.ensure_future(live.queue.get())
                done, _ = await asyncio.wait({getter, runner}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not live.queue.empty():
                    yield live.queue.get_nowait()
                yield runner.result()
                return
        finally:
            if not runner.done():
                self.abort(request.request_id)
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await runner

    def abort(self, request_id: str) -> None:
        """End the request with what it has (finish_reason abort)."""
        if self._closed:
            raise EngineClosedError("engine is shut down")
        live = self._live.get(request_id)
        if live is None:
            return
        live.aborted = True
        if live.task is not None and not live.task.done():
            live.task.get_loop().call_soon_threadsafe(live.task.cancel)

    async def release_memory(self, weights: bool = False) -> int:
        """The server's KV cache and weights are its own process's (and its own to manage): nothing freed here."""
        return 0

    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Stop every segment, load ``state`` into the server, continue as ``version``; returns seconds."""
        if self._closed:
            raise EngineClosedError("engine is shut down")
        t0 = time.perf_counter()
        while self._update_in_progress:  # one update at a time
            await asyncio.sleep(0.01)
        self._update_in_progress = True
        try:
            prepared = await self.prepare_weights(state, version)  # requests keep running meanwhile
            self._updating = True  # no new segment starts
            for live in list(self._live.values()):
                if live.task is not None and not live.task.done():
                    live.task.cancel()
            while any(live.task is not None and not live.task.done() for live in self._live.values()):
                await asyncio.sleep(0.005)
            await self._wait_server()
            t1 = time.perf_counter()
            await self.load_weights(self._client(), prepared, version)
            self.weight_load_s.append(time.perf_counter() - t1)
            self._version = version
            self.counts["weight_updates"] += 1
        finally:
            self._updating = False
            self._update_in_progress = False
        self.weight_update_s.append(time.perf_counter() - t0)
        return self.weight_update_s[-1]

    async def export_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]:
        """An external server's KV stays in it: nothing to migrate (a piece on another engine recomputes)."""
        return None, self._version

    async def import_kv(self, tokens: list[int], kv: torch.Tensor | None, version: int) -> int:
        return 0

    async def health(self) -> bool:
        try:
            r = await self._client().get(f"{self.url}/health", timeout=5.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def stats(self) -> dict:
        out: dict = {"backend": self.kind, "version": self._version, "running": len(self._live), **self.counts}
        if self.server is not None:
            out.update(restarts=self.server.restarts, startup_s=list(self.server.startup_s), ready=self.server.ready)
        out["weight_update_s"] = list(self.weight_update_s)
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for live in list(self._live.values()):
            if live.task is not None and not live.task.done():
                with contextlib.suppress(RuntimeError):
                    live.task.get_loop().call_soon_threadsafe(live.task.cancel)
        if self.server is not None:
            self.server.stop()
        self._clients.clear()  # their connections went with the server

    # -- serving one request ------------------------------------------------------------------------
    def _admit(self, request: GenerateRequest, *, stream: bool) -> _Live:
        if self._closed:
            raise EngineClosedError("engine is shut down")
        self.limits.check(request, can_decode=self.tokenizer is not None)
        if request.request_id in self._live:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        live = _Live(request, asyncio.Queue() if stream else None)
        self._live[request.request_id] = live
        self.counts["requests"] += 1
        return live

    async def _run(self, live: _Live) -> GenerateResult:
        req = live.request
        refused = 0
        try:
            while live.finish is None:
                while self._updating and not live.aborted:
                    await asyncio.sleep(0.005)
                if live.aborted or self._closed:
                    live.finish = FinishReason.ABORT
                    break
                seg = self._next_segment(live)
                if seg is None:
                    live.finish = FinishReason.LENGTH
                    break
                await self._wait_server()
                if self._updating:
                    continue
                version = self._version
                live.task = asyncio.ensure_future(self._read(live, seg, version))
                try:
                    await asyncio.wait({live.task})
                except asyncio.CancelledError:  # our caller went away: the request ends here
                    live.task.cancel()
                    live.aborted = True
                    raise
                if live.task.cancelled():  # a weight update, an abort or a shutdown stopped it
                    if self._closed:
                        raise EngineClosedError("engine is shut down")
                    continue
                if isinstance(live.task.exception(), _NotConnected):  # no token came: wait for the server, send again
                    refused += 1
                    if self.server is None or refused > 3:
                        raise ServerUnavailableError(f"the {self.kind} server does not answer "
                                                     f"({live.task.exception()}): retry the call")
                    self.server.check()
                    await asyncio.sleep(0.5)
                    continue
                live.task.result()  # raises what the server did wrong
            if live.finish == FinishReason.ABORT:
                self.counts["aborted"] += 1
            return self._result(live)
        except (BackendError, EngineClosedError):
            self.counts["failed_requests"] += 1
            raise
        finally:
            live.task = None
            self._live.pop(req.request_id, None)

    def _next_segment(self, live: _Live) -> Segment | None:
        req, p = live.request, live.request.params
        tokens = req.prompt_token_ids + live.tokens
        room = min(p.max_tokens - len(live.tokens), self.limits.max_seq_len - len(tokens))
        if room <= 0:
            return None
        stops = self.stop_rules.stop_token_ids(p)
        seed = p.seed if p.seed is None or not live.tokens else derive_seed(p.seed, len(live.tokens))
        live.segments += 1
        self.counts["segments"] += 1
        sid = req.request_id if live.segments == 1 else f"{req.request_id}~{live.segments - 1}"
        return Segment(sid, tokens, room, p, stops, seed)

    async def _read(self, live: _Live, seg: Segment, version: int) -> None:
        """Take the segment's tokens as they come; ends when the server finishes it or a stop string hits."""
        p = live.request.params
        seg_start = len(live.tokens)
        try:
            async for piece in self.stream_segment(self._client(), seg):
                if piece.cached_tokens is not None and live.segments == 1:
                    live.cached = piece.cached_tokens
                for tok, served in zip(piece.token_ids, piece.logprobs) if live.finish is None else ():
                    logprob, sample_logprob, exact = self._logprobs(served, p)
                    if not exact:
                        self.counts["inexact_logprob_tokens"] += 1
                    live.tokens.append(int(tok))
                    live.logprobs.append(logprob)
                    live.sample_logprobs.append(sample_logprob)
                    live.versions.append(version)
                    self.counts["generated_tokens"] += 1
                    if live.first_token is None:
                        live.first_token = time.perf_counter()
                    if live.queue is not None:
                        event = TokenEvent(int(tok), logprob, sample_logprob, version, len(live.tokens) - 1)
                        live.queue.put_nowait(event)
                    reason = self.stop_rules.reason(live.request, live.tokens, int(tok))
                    if reason is not None:
                        live.finish = reason
                        return
                if piece.finish_reason is not None and live.finish is None:
                    live.finish = self._server_finish(live, piece.finish_reason)  # read on: usage comes last
        except (httpx.TransportError, httpx.RemoteProtocolError) as e:
            self._clients.pop(asyncio.get_running_loop(), None)  # its pooled connections may be to a dead server
            if self.server is not None:
                self.server.check()
            if not live.tokens[seg_start:]:  # nothing came back from this segment: it may simply be sent again
                raise _NotConnected(f"{type(e).__name__}: {e}") from e
            raise ServerUnavailableError(
                f"the {self.kind} server dropped the request ({type(e).__name__}: {e}); it is being restarted if it "
                "died: retry the call") from e
        if live.finish is None:
            raise ServerUnavailableError(f"the {self.kind} server ended the stream of {seg.request_id} without a "
                                         "finish reason: retry the call")

    def _logprobs(self, served: float, p: SamplingParams) -> tuple[float, float, bool]:
        """(logprob, sample_logprob, exact) of a token whose log-prob the server sent as ``served``: the server
        gives one of the two (``logprobs_kind``); the other is the same number when the sampling distribution
        is the model's own (temperature 1, no top-k / top-p), 0.0 for greedy."""
        if p.greedy:
            return served, 0.0, True  # a greedy row's processed log-probs are the raw ones in vLLM and SGLang
        same = p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
        return served, served, same

    def _server_finish(self, live: _Live, reason: str) -> FinishReason:
        if reason == "length":
            return FinishReason.LENGTH
        if reason == "stop":
            return FinishReason.STOP
        if reason == "abort" and live.aborted:
            return FinishReason.ABORT
        raise BackendError(f"the {self.kind} server ended a request with finish reason {reason!r}")

    def _result(self, live: _Live) -> GenerateResult:
        end = time.perf_counter()
        req = live.request
        return GenerateResult(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), token_ids=list(live.tokens),
            logprobs=list(live.logprobs), sample_logprobs=list(live.sample_logprobs), versions=list(live.versions),
            finish_reason=live.finish or FinishReason.ABORT, engine_id=self.engine_id, cached_prompt_tokens=live.cached,
            queued_s=0.0, first_token_s=(live.first_token or end) - live.submitted, total_s=end - live.submitted,
        )

    # -- plumbing ---------------------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[old]
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits)
            self._clients[loop] = client
        return client

    async def _wait_server(self) -> None:
        if self.server is not None and not (self.server.check() and self.server.ready):
            try:
                await asyncio.to_thread(self.server.wait_ready)
            except ServerUnavailableError:
                if self._closed:
                    raise EngineClosedError("engine is shut down") from None
                raise
