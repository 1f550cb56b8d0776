"""OpenAI response and stream-chunk bodies, plus arborl's extra fields.

Extras on every response: ``policy_version`` (oldest policy version among the generated tokens,
the engine's version when none), per choice ``call_id`` (for rewards) and ``policy_version``;
with ``return_token_ids``: top-level ``prompt_token_ids`` and per choice ``token_ids`` (vLLM's
convention). ``logprobs`` are the raw temperature-1 log-probabilities (what the trainer recomputes).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from arborl.gateway.toolcalls import ParsedOutput
from arborl.types import Call, FinishReason, GenerateResult


@dataclass
class ServedChoice:
    index: int
    result: GenerateResult
    call: Call
    text: str  # completion text (no end token, cut at the stop string)
    parsed: ParsedOutput | None  # chat: content and tool calls

    @property
    def finish_reason(self) -> str:
        r = self.result.finish_reason
        if r == FinishReason.STOP and self.parsed is not None and self.parsed.tool_calls:
            return "tool_calls"
        return r.value

    @property
    def policy_version(self) -> int | None:
        return min(self.result.versions) if self.result.versions else None

    def message(self) -> dict[str, Any]:
        assert self.parsed is not None
        msg: dict[str, Any] = {"role": "assistant", "content": self.parsed.content}
        if self.parsed.tool_calls:
            msg["tool_calls"] = [t.to_openai() for t in self.parsed.tool_calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, choices: list[ServedChoice], cached: int) -> dict[str, Any]:
    completion = sum(len(c.result.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response_version(choices: list[ServedChoice], engine_version: int) -> int:
    vs = [c.policy_version for c in choices if c.policy_version is not None]
    return min(vs) if vs else engine_version


def token_logprobs(decode_one, token_ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    out = []
    for t, logprob in zip(token_ids, logprobs):
        s = decode_one(t)
        out.append({"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8")), "top_logprobs": []})
    return out


def chat_response(
    *,
    rid: str,
    model: str,
    created: int,
    choices: list[ServedChoice],
    prompt_ids_per_choice: bool,
    return_token_ids: bool,
    logprobs: bool,
    decode_one,
    engine_version: int,
) -> dict[str, Any]:
    out_choices = []
    for c in choices:
        ch: dict[str, Any] = {
            "index": c.index,
            "message": c.message(),
            "finish_reason": c.finish_reason,
            "logprobs": {"content": token_logprobs(decode_one, c.result.token_ids, c.result.logprobs)} if logprobs else None,
            "call_id": c.call.call_id,
            "policy_version": c.policy_version,
        }
        if return_token_ids:
            ch["token_ids"] = list(c.result.token_ids)
            if prompt_ids_per_choice:
                ch["prompt_token_ids"] = list(c.result.prompt_token_ids)
        out_choices.append(ch)
    prompt = choices[0].result.prompt_token_ids
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out_choices,
        "usage": usage(len(prompt), choices, choices[0].result.cached_prompt_tokens),
        "policy_version": response_version(choices, engine_version),
        "system_fingerprint": None,
    }
    if return_token_ids:
        body["prompt_token_ids"] = list(prompt)
    return body


def completion_response(
    *,
    rid: str,
    model: str,
    created: int,
    choices: list[ServedChoice],
    prompt_tokens: int,
    return_token_ids: bool,
    logprobs: bool,
    decode_one,
    engine_version: int,
) -> dict[str, Any]:
    out_choices = []
    for c in choices:
        ch: dict[str, Any] = {
            "index": c.index,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": completion_logprobs(decode_one, c.result.token_ids, c.result.logprobs) if logprobs else None,
            "call_id": c.call.call_id,
            "policy_version": c.policy_version,
        }
        if return_token_ids:
            ch["token_ids"] = list(c.result.token_ids)
            ch["prompt_token_ids"] = list(c.result.prompt_token_ids)
        out_choices.append(ch)
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out_choices,
        "usage": usage(prompt_tokens, choices, sum(c.result.cached_prompt_tokens for c in choices)),
        "policy_version": response_version(choices, engine_version),
    }
    return body


def completion_logprobs(decode_one, token_ids: list[int], logprobs: list[float], *, start: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``text_offset`` counts from ``start`` (a stream's
    earlier chunks)."""
    tokens = [decode_one(t) for t in token_ids]
    offsets, pos = [], start
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_chunk(rid: str, model: str, created: int, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices, **extra}


def completion_chunk(rid: str, model: str, created: int, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices, **extra}


def now() -> int:
    return int(time.time())
