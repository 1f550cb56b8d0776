"""The OpenAI request bodies the gateway accepts, validated with messages that say what to fix.

Unknown fields are ignored (clients send many); known fields are type-checked. Fields the engine
cannot honour are listed by ``unsupported()`` and rejected or ignored per
``gateway.unsupported_params``. vLLM-style extensions: ``return_token_ids``, ``prompt_token_ids``
(chat), ``top_k``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from arborl.gateway.errors import BadRequestError

T = TypeVar("T", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class FunctionSpec(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class _Sampling(_Body):
    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extensions
    return_token_ids: bool = False
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _common_unsupported(self) -> list[str]:
        out = []
        if self.frequency_penalty:
            out.append("frequency_penalty")
        if self.presence_penalty:
            out.append("presence_penalty")
        if self.logit_bias:
            out.append("logit_bias")
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[Any] | None = None
    prompt_token_ids: list[int] | None = None  # token-in: replaces messages
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        out = self._common_unsupported()
        if self.top_logprobs:
            out.append("top_logprobs (only the sampled token's log-probability is returned)")
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            out.append("tool_choice other than 'auto' / 'none' (the model cannot be forced to call a tool)")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            out.append("response_format (no constrained decoding)")
        for f in ("functions", "function_call", "audio", "prediction"):
            if (self.model_extra or {}).get(f):
                out.append(f)
        return out


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def unsupported(self) -> list[str]:
        out = self._common_unsupported()
        if self.logprobs and self.logprobs > 1:
            out.append("logprobs > 1 (only the sampled token's log-probability is returned)")
        if self.echo:
            out.append("echo")
        if self.suffix:
            out.append("suffix")
        if self.best_of and self.best_of > self.n:
            out.append("best_of")
        return out


class SessionCreate(_Body):
    task_id: str = ""
    group_id: str = ""
    agent_kind: str = "blackbox"
    stitching: bool | None = None  # None: gateway.stitching
    metadata: dict[str, Any] = Field(default_factory=dict)


class RewardPost(_Body):
    value: float = Field(allow_inf_nan=False)
    name: str = Field("agent", min_length=1)
    call_id: str | None = None


class InteractionPost(_Body):
    """An environment interaction (a tool run, an observation) to append to the episode; any fields.

    ``kind`` names it (e.g. "tool"); the other fields are kept as given (JSON values)."""

    kind: str = Field("interaction", min_length=1)


class FinishPost(_Body):
    status: Literal["finished", "failed", "aborted"] = "finished"


MAX_JSON_DEPTH = 64  # nesting levels of arrays / objects a request body may have


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays / objects more than ``limit`` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _unpaired_surrogate(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string holding half of a UTF-16 surrogate pair
    (JSON's ``\\ud800`` escape decodes to one; it is not text a tokenizer can encode), or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, c in v.items():
                shown = k.encode("utf-8", "replace").decode()
                stack.append((c, f"{path}.{shown}" if path else shown))
                stack.append((k, f"{path}.<key {shown!r}>" if path else f"<key {shown!r}>"))
        elif isinstance(v, list):
            stack.extend((c, f"{path}[{i}]") for i, c in enumerate(v))
    return None


def parse_json(raw: bytes) -> Any:
    """The decoded request body; a BadRequestError when it is empty, not JSON, nested more than
    ``MAX_JSON_DEPTH`` levels (deeper bodies would exhaust the recursion of later stages), or holds a
    string that is not valid Unicode."""
    if not raw.strip():
        raise BadRequestError("the request body is empty: send a JSON object")
    too_deep = BadRequestError(f"the request body nests arrays / objects more than {MAX_JSON_DEPTH} levels deep")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise BadRequestError(f"the request body is not valid JSON{where}: {e}") from None
    except RecursionError:  # the decoder's own limit, far above MAX_JSON_DEPTH
        raise too_deep from None
    if (raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH) and _too_deep(value, MAX_JSON_DEPTH):
        raise too_deep
    if b"\\u" in raw and (where := _unpaired_surrogate(value)) is not None:
        raise BadRequestError(f"{where} holds an unpaired UTF-16 surrogate (a \\uD800-\\uDFFF escape without its "
                              "other half): strings must be valid Unicode", param=where)
    return value


def parse(model: type[T], body: Any) -> T:
    """``body`` (a decoded JSON value) as ``model``; a BadRequestError naming every bad field."""
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        parts, first = [], None
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "body"
            first = first or loc
            if err["type"] == "missing":
                parts.append(f"{loc}: required field is missing")
            else:
                got = err.get("input")
                shown = json.dumps(got)[:80] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
                parts.append(f"{loc}: {err['msg']} (got {shown})")
        raise BadRequestError("invalid request: " + "; ".join(parts), param=first) from None
