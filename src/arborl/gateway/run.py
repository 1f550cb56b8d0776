"""One request in flight: its engine requests (one per choice), their recording, its response or stream.

``RequestRun.start`` places the request in the engine pool and starts one task per choice; a
detached finaliser task waits for all of them and records their calls (``RequestContext.record``)
before ``response()`` returns or ``chunks()`` yields the last chunk. A failed choice aborts the others and records nothing; a client
that goes away (``abort()``) stops generation, and the partial calls are still recorded.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from arborl.engine import EngineClosedError, EngineError, TokenEvent
from arborl.gateway import openai_format as fmt
from arborl.gateway.context import RequestContext
from arborl.gateway.errors import BadRequestError, EngineFailedError, GatewayError, UnavailableError
from arborl.gateway.render import canonical, normalize_messages
from arborl.gateway.stitching import CallRecord
from arborl.gateway.textstream import TextStreamer, completion_text
from arborl.gateway.toolcalls import ParsedOutput, parse_tool_calls
from arborl.types import Call, FinishReason, GenerateRequest, GenerateResult, InvalidRequestError

if TYPE_CHECKING:
    from arborl.engine.pool import Lease
    from arborl.gateway.sessions import Session

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """One engine request = one choice = one recorded call."""

    index: int
    request: GenerateRequest
    meta: dict[str, Any]
    chain: list[str] | None = None  # chat: the request's message chain (for the history record)
    prompt_text: str | None = None  # completions with a text prompt


class RequestRun:
    """One request in flight: its engine requests, their recording, its response or stream."""

    def __init__(self, ctx: RequestContext, session: Session, kind: str, req: Any, choices: list[Choice],
                 tools: list[dict] | None) -> None:
        self.ctx = ctx
        self.session = session
        self.kind = kind  # "chat" | "completion"
        self.req = req
        self.choices = choices
        self.tools = tools
        self.tool_names = {t["function"]["name"] for t in tools} if tools else None
        self.stream = bool(req.stream)
        self.client_gone = False
        self.id = fmt.new_response_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = fmt.now()
        self._queue: asyncio.Queue | None = None
        self._final: asyncio.Task | None = None
        self.lease: Lease | None = None

    # -- running ----------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.session
        try:
            with s.lock:
                self.lease = self.ctx.engines.lease(session_id=s.session_id, group_id=s.episode.group_id,
                                                    current=s.engine_index, n=len(self.choices))
                if self.lease.index is not None:
                    s.engine_index = self.lease.index
                s.in_flight += 1
        except EngineClosedError as e:
            err = UnavailableError(str(e))
            self.ctx.stats.count_error(err)
            raise err from None
        self.engine = self.lease.engine
        for j in self.choices:
            j.meta["routing"] = self.lease.how
            j.request.group_id = s.episode.group_id  # speculative drafts share the group's tokens
        self.ctx.stats.add("requests", 1)
        self._queue = asyncio.Queue() if self.stream else None
        producers = [asyncio.ensure_future(self._produce(j)) for j in self.choices]
        self._final = self.ctx.spawn(self._finalize(producers))

    async def _produce(self, job: Choice) -> GenerateResult:
        replayed = self.session.replayed(job.request.prompt_token_ids) if len(self.choices) == 1 else None
        if replayed is not None:
            return self._replay(job, replayed)
        if not self.stream:
            return await self.engine.generate(job.request)
        assert self._queue is not None
        try:
            result = None
            async for ev in self.engine.stream(job.request):
                if isinstance(ev, TokenEvent):
                    self._queue.put_nowait((job.index, ev))
                else:
                    result = ev
            assert result is not None
            return result
        finally:
            self._queue.put_nowait((job.index, None))

    def _replay(self, job: Choice, call: Call) -> GenerateResult:
        """A recorded call served again as it was (its tokens, log-probs and versions)."""
        job.meta["replayed_from"] = call.call_id
        n = len(call.completion_token_ids)
        if self._queue is not None:
            for i, (t, logprob, sample_logprob, v) in enumerate(zip(call.completion_token_ids, call.logprobs,
                                                                    call.sample_logprobs, call.versions)):
                self._queue.put_nowait((job.index, TokenEvent(t, logprob, sample_logprob, v, i)))
            self._queue.put_nowait((job.index, None))
        self.ctx.stats.add("replayed_tokens", n)
        return GenerateResult(job.request.request_id, list(call.prompt_token_ids), list(call.completion_token_ids),
                              list(call.logprobs), list(call.sample_logprobs), list(call.versions),
                              FinishReason(call.finish_reason), engine_id="replay")

    def abort(self) -> None:
        """The client went away: stop generating; what was generated is still recorded (finish_reason abort)."""
        if self._final is not None and self._final.done():
            return
        self.client_gone = True
        for j in self.choices:
            try:
                self.engine.abort(j.request.request_id)
            except EngineClosedError:
                pass

    async def _finalize(self, producers: list[asyncio.Future]) -> list[fmt.ServedChoice]:
        try:
            done, pending = await asyncio.wait(producers, return_when=asyncio.FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for j in self.choices:  # drop the whole request: a retry must not duplicate choices
                    try:
                        self.engine.abort(j.request.request_id)
                    except EngineClosedError:
                        pass
                if pending:
                    await asyncio.wait(pending)
                for f in producers:  # retrieve every outcome (no "exception never retrieved" noise)
                    if not f.cancelled():
                        f.exception()
                raise self._map_error(failed[0].exception())
            served, records = [], []
            for job, fut in zip(self.choices, producers):
                s, rec = self._served(job, fut.result())
                served.append(s)
                records.append(rec)
            try:
                await asyncio.to_thread(self.ctx.record, self.session, served, records)
            except Exception as e:  # noqa: BLE001
                log.exception("recording failed")
                raise GatewayError(f"the call could not be recorded in the data pool: {e}") from e
            if any(s.result.finish_reason == FinishReason.ABORT for s in served):
                self.ctx.stats.add("aborted", 1)
            return served
        except GatewayError as e:
            self.ctx.stats.count_error(e)
            raise
        finally:
            if self.lease is not None:
                self.lease.release()
            with self.session.lock:
                self.session.in_flight -= 1

    def _map_error(self, e: BaseException | None) -> GatewayError:
        if isinstance(e, EngineClosedError):
            if self.lease is not None:
                self.lease.lost()
            return UnavailableError(f"engine {self.engine.engine_id} is shut down; retry the call (another engine may serve it)")
        if isinstance(e, InvalidRequestError):
            return BadRequestError(str(e))
        if isinstance(e, EngineError):
            return EngineFailedError(f"the engine failed while serving this call ({e}); nothing was recorded and "
                                     "the session is still usable: retry the call")
        return EngineFailedError(f"internal error while serving this call: {e!r}; nothing was recorded")

    def _served(self, job: Choice, result: GenerateResult) -> tuple[fmt.ServedChoice, CallRecord | None]:
        ctx = self.ctx
        end_ids = ctx.eos_ids | set(job.request.params.stop_token_ids)
        text = completion_text(ctx.text.decode, result.token_ids, end_ids if result.finish_reason == FinishReason.STOP else (), job.request.params.stop)
        meta = dict(job.meta)
        parsed = None
        response_key = None
        if self.kind == "chat":
            if self.tools:
                parsed = parse_tool_calls(text, self.tool_names)
                meta["tool_calls"] = len(parsed.tool_calls)
                if parsed.errors:
                    meta["malformed_tool_calls"] = len(parsed.errors)
                    meta["tool_call_errors"] = parsed.errors
            else:
                parsed = ParsedOutput(text, [], [])
        if result.finish_reason == FinishReason.ABORT and self.client_gone:
            meta["client_disconnected"] = True
        call = Call.from_result(self.session.session_id, result, meta=meta)
        served = fmt.ServedChoice(job.index, result, call, text, parsed)
        if result.finish_reason == FinishReason.ABORT:
            return served, None
        if parsed is not None:
            response_key = canonical(_normalized_reply(served.message()))
        full = array("i", result.prompt_token_ids)
        full.extend(result.token_ids)
        ends_turn = result.finish_reason == FinishReason.STOP and bool(result.token_ids) and result.token_ids[-1] in end_ids
        rec = CallRecord(
            call_id=call.call_id,
            full_ids=full,
            prompt_len=len(result.prompt_token_ids),
            ends_turn=ends_turn,
            chain=job.chain,
            response_key=response_key,
            text_key=(job.prompt_text + ctx.text.decode_raw(result.token_ids)) if job.prompt_text is not None else None,
        )
        return served, rec

    # -- results ----------------------------------------------------------------------------------
    async def served(self) -> list[fmt.ServedChoice]:
        assert self._final is not None
        try:
            return await asyncio.shield(self._final)
        except asyncio.CancelledError:
            self.abort()  # the caller was cancelled: stop generating; recording continues
            raise

    async def response(self) -> dict[str, Any]:
        """The full response body (waits until the calls are recorded)."""
        choices = sorted(await self.served(), key=lambda c: c.index)
        ctx = self.ctx
        if self.kind == "chat":
            return fmt.chat_response(
                rid=self.id, model=ctx.model_name, created=self.created, choices=choices,
                prompt_ids_per_choice=False, return_token_ids=self.req.return_token_ids,
                logprobs=self.req.logprobs, decode_one=ctx.text.decode_one, engine_version=self.engine.version,
            )
        prompt_tokens = sum(len(j.request.prompt_token_ids) for j in self.choices if j.meta["choice"] == 0)
        return fmt.completion_response(
            rid=self.id, model=ctx.model_name, created=self.created, choices=choices, prompt_tokens=prompt_tokens,
            return_token_ids=self.req.return_token_ids, logprobs=bool(self.req.logprobs),
            decode_one=ctx.text.decode_one, engine_version=self.engine.version,
        )

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks; the last ones (finish reasons, tool calls, usage) come after recording.
        Closing the iterator early aborts the engine requests (the partial calls are recorded)."""
        assert self.stream and self._queue is not None
        ctx, req, chat = self.ctx, self.req, self.kind == "chat"
        mk = fmt.chat_chunk if chat else fmt.completion_chunk
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want_ids, want_lp = req.return_token_ids, bool(req.logprobs)
        streamers = {
            j.index: TextStreamer(ctx.text.decode, ctx.eos_ids | set(j.request.params.stop_token_ids),
                                  j.request.params.stop, tools=bool(self.tools))
            for j in self.choices
        }
        offsets = {j.index: 0 for j in self.choices}  # completions: text_offset of each choice's next token
        finished = False
        try:
            if chat:
                first = [{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for j in self.choices]
                extra = {"prompt_token_ids": list(self.choices[0].request.prompt_token_ids)} if want_ids else {}
                yield mk(self.id, ctx.model_name, self.created, first, **extra)
            open_ = len(self.choices)
            while open_:
                i, ev = await self._queue.get()
                batch: dict[int, list[TokenEvent]] = {}
                while True:  # coalesce what is already queued into one chunk per choice
                    if ev is None:
                        open_ -= 1
                    else:
                        batch.setdefault(i, []).append(ev)
                    if self._queue.empty():
                        break
                    i, ev = self._queue.get_nowait()
                out = []
                for idx, evs in batch.items():
                    text = "".join(streamers[idx].push(e.token_id) for e in evs)
                    if not (text or want_ids or want_lp):
                        continue
                    ch: dict[str, Any] = {"index": idx, "logprobs": None, "finish_reason": None}
                    ids, logprobs = [e.token_id for e in evs], [e.logprob for e in evs]
                    if chat:
                        ch["delta"] = {"content": text}
                        if want_lp:
                            ch["logprobs"] = {"content": fmt.token_logprobs(ctx.text.decode_one, ids, logprobs)}
                    else:
                        ch["text"] = text
                        if want_lp:
                            ch["logprobs"] = fmt.completion_logprobs(ctx.text.decode_one, ids, logprobs, start=offsets[idx])
                            offsets[idx] += sum(len(t) for t in ch["logprobs"]["tokens"])
                    if want_ids:
                        ch["token_ids"] = [e.token_id for e in evs]
                    out.append(ch)
                if out:
                    yield mk(self.id, ctx.model_name, self.created, out)
            served = sorted(await self.served(), key=lambda c: c.index)
            finished = True
            version = fmt.response_version(served, self.engine.version)
            last = []
            for s in served:
                content = s.parsed.content if s.parsed is not None else s.text
                rest = streamers[s.index].flush(content)
                ch = {"index": s.index, "logprobs": None, "finish_reason": s.finish_reason,
                      "call_id": s.call.call_id, "policy_version": s.policy_version}
                if chat:
                    delta: dict[str, Any] = {"content": rest} if rest else {}
                    if s.parsed is not None and s.parsed.tool_calls:
                        delta["tool_calls"] = [{"index": k, **t.to_openai()} for k, t in enumerate(s.parsed.tool_calls)]
                    ch["delta"] = delta
                else:
                    ch["text"] = rest
                    if want_ids:
                        ch["prompt_token_ids"] = list(s.result.prompt_token_ids)
                last.append(ch)
            prompt_tokens = sum(len(j.request.prompt_token_ids) for j in self.choices if j.meta["choice"] == 0)
            usage = fmt.usage(prompt_tokens, served, sum(s.result.cached_prompt_tokens for s in served) if not chat
                              else served[0].result.cached_prompt_tokens)
            if include_usage:
                yield mk(self.id, ctx.model_name, self.created, last, policy_version=version)
                yield mk(self.id, ctx.model_name, self.created, [], usage=usage, policy_version=version)
            else:
                yield mk(self.id, ctx.model_name, self.created, last, usage=usage, policy_version=version)
        finally:
            if not finished:
                self.abort()


def _normalized_reply(msg: dict[str, Any]) -> dict[str, Any]:
    """Our response message in the normalised shape of an incoming message (for ``canonical``)."""
    return normalize_messages([msg])[0]
