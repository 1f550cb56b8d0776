"""The gateway core: a plain Python class, no HTTP.

``Gateway`` owns the sessions, places calls in the engine pool, builds prompts (chat template, token
stitching), records every served call to the data pool with the engine's token ids, and formats
OpenAI responses. The FastAPI app (``gateway.app``) is a thin layer over it, and the white-box
agent's ``SessionClient`` calls it in-process: both go through the same recording path.

One request runs as a ``RequestRun`` (``gateway.run``), which sees the gateway only through a narrow
``RequestContext`` (``gateway.context``): one engine request per choice (``n``) and
a detached finaliser that records their calls before the response (or the stream's last chunk) is
released. So a 200 means "recorded", a client that goes away cannot interrupt recording, and a
failed engine request records nothing (the other choices of that request are aborted and dropped
with it, so a client retry never duplicates).

Threads: the HTTP server's event loop and in-process callers on other loops/threads may share one
``Gateway``; shared state is behind ``threading`` locks, data-pool writes run in worker threads.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from arborl.config import GatewayConfig
from arborl.datapool import DataPool
from arborl.engine.pool import EnginePool
from arborl.gateway.context import GatewayStats, RequestContext, TextCodec
from arborl.gateway.errors import BadRequestError, GatewayError, NotFoundError
from arborl.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse
from arborl.gateway.render import ChatRenderer, normalize_messages
from arborl.gateway.run import Choice, RequestRun
from arborl.gateway.sessions import Session, SessionInfo, SessionStore, episode_meta, new_key
from arborl.gateway.stitching import Stitched, message_chain, stitch_chat
from arborl.prefix import common_prefix_len
from arborl.train.samples import episode_samples
from arborl.types import Call, Episode, EpisodeStatus, GenerateRequest, InvalidRequestError, SamplingParams, new_id, to_dict

log = logging.getLogger(__name__)


class Gateway:
    """Sessions, routing, prompt building, recording. See the module docstring.

    ``engines``: engines (``engine.face.EngineFace``) serving the same policy. ``tokenizer`` may be None for a model
    without one (then only token-in requests work). The admin key is ``admin_key``, else
    ``$ARBORL_ADMIN_KEY``, else ``config.admin_key``, else a random one (``self.admin_key``).
    ``trust_agent_rewards`` (``rollout.trust_agent_rewards``): new sessions let their agent key post rewards.
    """

    def __init__(
        self,
        engines: EnginePool,
        *,
        datapool: DataPool,
        tokenizer: Any = None,
        model_name: str = "arborl",
        config: GatewayConfig | None = None,
        admin_key: str | None = None,
        max_seq_len: int | None = None,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        trust_agent_rewards: bool = False,
    ) -> None:
        self.config = config or GatewayConfig()
        self.trust_agent_rewards = bool(trust_agent_rewards)
        self.engines = engines
        self.max_seq_len = int(max_seq_len or engines.max_seq_len)
        self.vocab_size = int(vocab_size or engines.vocab_size)
        self.eos_ids = frozenset(int(t) for t in (eos_token_ids if eos_token_ids is not None else engines.eos_token_ids))
        self.tokenizer = tokenizer
        self.text = TextCodec(tokenizer)
        self.renderer = (
            ChatRenderer(tokenizer, self.config.tool_prompt)
            if tokenizer is not None and getattr(tokenizer, "chat_template", None)
            else None
        )
        self.pool = datapool
        self.model_name = self.config.model_name or model_name
        self.admin_key = admin_key or os.environ.get("ARBORL_ADMIN_KEY") or self.config.admin_key or new_key()
        self.sessions = SessionStore(self.admin_key)
        self.stats = GatewayStats()
        self.requests = RequestContext(engines, datapool, self.text, eos_ids=self.eos_ids, model_name=self.model_name,
                                       stats=self.stats)
        self._created = int(time.time())

    # ------------------------------------------------------------------ sessions
    async def create_session(
        self,
        *,
        task_id: str = "",
        group_id: str = "",
        agent_kind: str = "blackbox",
        stitching: bool | None = None,
        metadata: dict[str, Any] | None = None,
        episode_id: str | None = None,
        trust_rewards: bool | None = None,
        replay: list[Call] | None = None,
    ) -> SessionInfo:
        """A new session = a new running episode in the data pool, with its own agent key and harness key;
        ``trust_rewards`` (default: the gateway's ``trust_agent_rewards``) lets the agent key post rewards.
        ``replay``: calls recorded by an episode a kill interrupted; while the new episode's requests ask
        exactly their prompts, in order, they are served from the record (no decoding) and recorded again
        (meta ``replayed_from``), so a resumed episode continues from its recorded tokens."""
        stitch = self.config.stitching if stitching is None else bool(stitching)
        ep = Episode(task_id=task_id, group_id=group_id, agent_kind=agent_kind, meta=episode_meta(metadata or {}, stitch))
        if episode_id:
            ep.episode_id = episode_id
        trusted = self.trust_agent_rewards if trust_rewards is None else bool(trust_rewards)
        session = Session(episode=ep, stitching=stitch, trust_rewards=trusted, replay=list(replay or []))
        key, harness_key = new_key(), new_key()
        await asyncio.to_thread(self.pool.put_episode, ep)
        self.sessions.add(session, key, harness_key)
        return SessionInfo(session, key, harness_key)

    async def add_reward(self, session: Session, value: float, *, name: str = "agent", call_id: str | None = None) -> dict[str, Any]:
        """A step / process reward, kept in ``episode.meta["rewards"]``. In-process callers are the harness;
        over HTTP the route checks who may post (``SessionStore.for_reward``)."""
        if call_id is not None:
            call = await asyncio.to_thread(self.pool.get_call, call_id)
            if call is None or call.episode_id != session.session_id:
                raise NotFoundError(f"call {call_id!r} is not a call of this session", param="call_id")
        entry = {"name": name, "value": float(value), "call_id": call_id, "after_call": session.last_call_id, "at": time.time()}
        with session.lock:
            session.episode.meta.setdefault("rewards", []).append(entry)
        await asyncio.to_thread(self._write_episode, session)
        return entry

    async def add_interaction(self, session: Session, record: dict[str, Any]) -> None:
        """An environment interaction (a tool run, ...), appended to ``episode.interactions``."""
        with session.lock:
            session.episode.interactions.append({"after_call": session.last_call_id, "at": time.time(), **record})
        await asyncio.to_thread(self._write_episode, session)

    async def settle(self, session: Session, timeout_s: float = 30.0) -> bool:
        """Wait until none of the session's requests is in flight (each is recorded or failed).
        Callers that abandon requests (a timed-out agent, a killed process) settle before they
        finish the session or close their event loop. Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        while session.in_flight > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def set_meta(self, session: Session, **items: Any) -> None:
        """Set keys of the episode's meta (e.g. the agent's outcome)."""
        with session.lock:
            session.episode.meta.update(items)
        await asyncio.to_thread(self._write_episode, session)

    async def finish(self, session: Session, status: EpisodeStatus | str = EpisodeStatus.FINISHED) -> dict[str, Any]:
        """End the session: no more model calls; its episode gets ``status``. Idempotent."""
        st = EpisodeStatus(status)
        if st == EpisodeStatus.RUNNING:
            raise BadRequestError("finish needs a final status: finished, failed or aborted", param="status")
        with session.lock:
            if not session.finished:
                session.episode.status = st
                session.episode.finished_at = time.time()
                session.history.clear()  # stitching state is no longer needed
        await asyncio.to_thread(self._write_episode, session)
        return {"session_id": session.session_id, "status": session.episode.status.value, "calls": session.calls}

    def _write_episode(self, session: Session) -> None:
        with session.write_lock:  # the newest in-memory state is what ends up stored
            with session.lock:
                ep = session.episode
                meta, inter = copy.deepcopy(ep.meta), copy.deepcopy(ep.interactions)
                status, finished_at = ep.status, ep.finished_at
            self.pool.update_episode(
                session.session_id, status=status, meta=meta, interactions=inter, finished_at=finished_at
            )

    async def trajectory(self, session: Session) -> dict[str, Any]:
        """The session's recorded calls, their samples (token ids, loss mask, logprobs, versions,
        chunk ids), drift events, rewards and interactions, read back from the data pool."""
        ep = await asyncio.to_thread(self.pool.get_episode, session.session_id)
        assert ep is not None
        samples = episode_samples(ep.calls)
        calls = [
            {
                "call_id": c.call_id,
                "prompt_token_ids": c.prompt_token_ids,
                "completion_token_ids": c.completion_token_ids,
                "loss_mask": [0] * len(c.prompt_token_ids) + [1] * len(c.completion_token_ids),
                "logprobs": c.logprobs,
                "sample_logprobs": c.sample_logprobs,
                "versions": c.versions,
                "finish_reason": c.finish_reason,
                "engine_id": c.engine_id,
                "meta": c.meta,
            }
            for c in ep.calls
        ]
        return {
            "session_id": ep.episode_id,
            "episode_id": ep.episode_id,
            "task_id": ep.task_id,
            "group_id": ep.group_id,
            "status": ep.status.value,
            "stitching": session.stitching,
            "calls": calls,
            "samples": [to_dict(s) for s in samples],
            "drift_events": [{"call_id": c.call_id, **c.meta["drift"]} for c in ep.calls if c.meta.get("drift")],
            "rewards": ep.meta.get("rewards", []),
            "interactions": ep.interactions,
        }

    # ------------------------------------------------------------------ models / health
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "arborl",
            "max_model_len": self.max_seq_len,
            "policy_version": self.engines.version,
        }

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFoundError(
                f"model {model!r} does not exist: this gateway serves {self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.model_name,
            "engines": self.engines.engine_rows(),
            "dispatch": self.engines.dispatch_stats() if self.engines.dispatcher is not None else None,
            "sessions": len(self.sessions.all()),
            "stats": self.stats.as_dict(),
        }

    # ------------------------------------------------------------------ chat
    async def chat_completion(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions (non-streaming) in-process: the response body."""
        run = self.start_chat(session, {**body, "stream": False})
        return await run.response()

    def start_chat(self, session: Session, body: Any) -> RequestRun:
        """Validate, build the prompt and start the engine requests; raises GatewayError on bad input."""
        try:
            req = parse(ChatCompletionRequest, body)
            session.check_open()
            self.check_model(req.model)
            ignored = self._unsupported(req.unsupported())
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
            meta: dict[str, Any] = {"endpoint": "chat"}
            chain = None
            if req.prompt_token_ids is not None:
                if req.messages:
                    raise BadRequestError("send either messages or prompt_token_ids, not both", param="prompt_token_ids")
                prompt = list(req.prompt_token_ids)
                meta["input"] = "tokens"
                with session.lock:
                    drift = session.history.drift(prompt)
                if drift:
                    meta["drift"] = drift
            else:
                if self.renderer is None:
                    raise BadRequestError("this model has no tokenizer with a chat template: send prompt_token_ids instead of messages")
                if req.messages is None:
                    raise BadRequestError("messages is required (or prompt_token_ids, token-in)", param="messages")
                messages = normalize_messages(req.messages)
                chain = message_chain(messages, tools)
                prompt, info = self._chat_prompt(session, messages, chain, tools)
                meta["input"] = "messages"
                meta.update(info)
                if self.config.record_messages:  # what `arborl audit` re-renders
                    meta["request"] = {"messages": messages, "tools": tools}
            if ignored:
                meta["ignored_params"] = ignored
            if tools:
                meta["tools"] = [t["function"]["name"] for t in tools]
            max_tokens = req.max_completion_tokens or req.max_tokens or self.config.default_max_tokens
            choices = self._plan_choices(req, [(prompt, meta, chain, None)], max_tokens)
            run = RequestRun(self.requests, session, "chat", req, choices, tools)
        except GatewayError as e:
            self.stats.count_error(e)
            raise
        run.start()
        return run

    def _chat_prompt(
        self, session: Session, messages: list[dict[str, Any]], chain: list[str], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], dict[str, Any]]:
        """The prompt token ids of a chat request, and what to note on the call (stitch / drift)."""
        assert self.renderer is not None
        full_text = self.renderer.render(messages, tools, add_generation_prompt=True)
        with session.lock:
            same = session.history.same_request(chain) if session.stitching else None
            found = session.history.find_parent(messages, chain)
        if same is not None:
            return same.prompt_ids, {"reused_prompt_of": same.call_id}
        reason = None
        if found is not None and session.stitching:
            got = stitch_chat(self.renderer, found[0], found[1], messages, tools, full_text)
            if isinstance(got, Stitched):
                full_ids = self.renderer.encode(full_text)
                same_len = common_prefix_len(full_ids, got.prompt_ids)
                exact = same_len == len(full_ids) == len(got.prompt_ids)
                # where a plain re-render would have differed from the tokens the policy produced
                got.info["retokenized_diff_at"] = None if exact else same_len
                self.stats.add("stitched", 1)
                return got.prompt_ids, {"stitch": got.info}
            reason = got
        elif found is not None:
            reason = "stitching_off"
        prompt = self.renderer.encode(full_text)
        with session.lock:
            drift = session.history.drift(prompt, messages=messages, chain=chain, reason=reason)
        if drift:
            self.stats.add("drift_events", 1)
            return prompt, {"drift": drift}
        return prompt, {}

    # ------------------------------------------------------------------ completions
    async def completion(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/completions (non-streaming) in-process."""
        run = self.start_completion(session, {**body, "stream": False})
        return await run.response()

    def start_completion(self, session: Session, body: Any) -> RequestRun:
        try:
            req = parse(CompletionRequest, body)
            session.check_open()
            self.check_model(req.model)
            ignored = self._unsupported(req.unsupported())
            p = req.prompt
            if isinstance(p, str):
                prompts: list[str | list[int]] = [p]
            elif p and all(isinstance(x, int) for x in p):
                prompts = [list(p)]  # type: ignore[arg-type]
            else:
                prompts = list(p)  # type: ignore[arg-type]
            if not prompts:
                raise BadRequestError("prompt is empty: send a string, a list of token ids, or a list of those", param="prompt")
            planned = []
            for prompt in prompts:
                meta: dict[str, Any] = {"endpoint": "completions"}
                if ignored:
                    meta["ignored_params"] = ignored
                if isinstance(prompt, str):
                    ids, info = self._text_prompt(session, prompt)
                    meta.update(input="text", **info)
                    planned.append((ids, meta, None, prompt))
                else:
                    with session.lock:
                        drift = session.history.drift(prompt)
                    meta["input"] = "tokens"
                    if drift:
                        meta["drift"] = drift
                    planned.append((list(prompt), meta, None, None))
            choices = self._plan_choices(req, planned, req.max_tokens or 16)
            run = RequestRun(self.requests, session, "completion", req, choices, None)
        except GatewayError as e:
            self.stats.count_error(e)
            raise
        run.start()
        return run

    def _text_prompt(self, session: Session, text: str) -> tuple[list[int], dict[str, Any]]:
        with session.lock:
            parent = session.history.find_text_parent(text) if session.stitching else None
        if parent is not None:
            assert parent.text_key is not None
            rest = self.text.encode(text[len(parent.text_key) :])
            ids = parent.full_ids.tolist() + rest
            return ids, {"stitch": {"parent_call": parent.call_id, "suffix_start": len(parent.full_ids), "suffix_tokens": len(rest)}}
        ids = self.text.encode(text)
        with session.lock:
            drift = session.history.drift(ids)
        return ids, ({"drift": drift} if drift else {})

    # ------------------------------------------------------------------ shared
    def _unsupported(self, names: list[str]) -> list[str]:
        if names and self.config.unsupported_params == "reject":
            raise BadRequestError(
                "unsupported parameter(s): " + "; ".join(names)
                + ". Remove them, or start the gateway with gateway.unsupported_params=ignore",
                param=names[0].split(" ")[0],
                code="unsupported_parameter",
            )
        return [n.split(" ")[0] for n in names]

    def _plan_choices(self, req: Any, planned: list[tuple[list[int], dict, list[str] | None, str | None]], max_tokens: int) -> list[Choice]:
        if req.n > self.config.max_n:
            raise BadRequestError(f"n is {req.n} but this gateway serves at most {self.config.max_n} choices (gateway.max_n)", param="n")
        stops = req.stops()
        if stops and self.tokenizer is None:
            raise BadRequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)", param="stop")
        choices = []
        for pi, (prompt, meta, chain, text) in enumerate(planned):
            if len(prompt) >= self.max_seq_len:
                raise BadRequestError(
                    f"the prompt has {len(prompt)} tokens but the model's context holds {self.max_seq_len} "
                    "(prompt + completion): shorten the conversation or raise engine.max_seq_len",
                    param="messages" if meta.get("input") == "messages" else "prompt",
                    code="context_length_exceeded",
                )
            for j in range(req.n):
                params = SamplingParams(
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=max(0, req.top_k or 0) if (req.top_k or 0) < self.vocab_size else 0,  # past the vocab: off
                    max_tokens=max_tokens,
                    stop_token_ids=list(req.stop_token_ids or []),
                    stop=stops,
                    ignore_eos=req.ignore_eos,
                    seed=None if req.seed is None else req.seed + j,
                )
                greq = GenerateRequest(list(prompt), params, request_id=new_id("req"))
                try:
                    greq.validate(self.vocab_size, self.max_seq_len)
                except InvalidRequestError as e:
                    raise BadRequestError(str(e), param="prompt_token_ids" if meta.get("input") == "tokens" else None) from None
                m = dict(meta, choice=j, n=req.n, params={"temperature": params.temperature, "top_p": params.top_p,
                                                           "top_k": params.top_k, "max_tokens": max_tokens, "seed": params.seed})
                choices.append(Choice(pi * req.n + j, greq, m, chain, text))
        return choices

    async def drain(self) -> None:
        """Wait until every request started on this event loop is recorded (or failed)."""
        await self.requests.drain()
