"""OpenAI chat messages -> the chat template's text -> token ids.

``ChatRenderer`` validates and normalises messages, puts ``tools`` into the prompt (through the
template when it supports tools, else as a system-prompt block, see ``toolcalls``), renders past
assistant tool calls and tool results, and tokenises. ``canonical`` gives the form two messages
are compared in (stitching asks "is this the assistant message we returned?").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from arborl.gateway.errors import BadRequestError
from arborl.gateway.toolcalls import format_tool_call, tools_system_prompt

ROLES = ("system", "developer", "user", "assistant", "tool")
_SENTINEL = "\u2063ARBORL\u2063TURN\u2063END\u2063"  # never produced by a tokenizer's decode of real text


def _text_of(content: Any, where: str) -> str:
    """OpenAI message content (str, None or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequestError(
                    f"{where}.content[{i}] is a {kind!r} part; this model reads text only (send "
                    '{"type": "text", "text": ...} parts or a string)',
                    param=f"{where}.content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequestError(f"{where}.content[{i}].text must be a string", param=f"{where}.content")
            out.append(text)
        return "".join(out)
    raise BadRequestError(f"{where}.content must be a string, a list of text parts or null", param=f"{where}.content")


def _args_obj(arguments: Any, where: str) -> Any:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments  # kept verbatim; the model sees what the agent sent
    raise BadRequestError(f"{where}.function.arguments must be a JSON string", param=where)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated messages in one shape: role, content (str), and where present name,
    tool_call_id and tool_calls ``[{"id", "name", "arguments": obj}]``. Raises BadRequestError."""
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequestError(f"{where} must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise BadRequestError(f"{where}.role is {role!r}; use one of {', '.join(ROLES)}", param=f"{where}.role")
        msg: dict[str, Any] = {"role": role, "content": _text_of(m.get("content"), where)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant":
                raise BadRequestError(f"{where} has tool_calls but role {role!r}; only assistant messages do", param=where)
            if not isinstance(calls, list):
                raise BadRequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            norm = []
            for j, c in enumerate(calls):
                cw = f"{where}.tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise BadRequestError(f"{cw} must look like {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=cw)
                norm.append({"id": str(c.get("id") or ""), "name": fn["name"], "arguments": _args_obj(fn.get("arguments"), cw)})
            msg["tool_calls"] = norm
        out.append(msg)
    return out


def canonical(msg: dict[str, Any]) -> str:
    """What two normalised messages are compared by: role, content, name, tool_call_id and the
    calls' names and arguments (ids and whitespace of the argument JSON do not matter)."""
    c: dict[str, Any] = {"role": msg["role"], "content": msg.get("content") or ""}
    for k in ("name", "tool_call_id"):
        if msg.get(k):
            c[k] = msg[k]
    if msg.get("tool_calls"):
        c["tool_calls"] = [[t["name"], t["arguments"]] for t in msg["tool_calls"]]
    return json.dumps(c, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return digest(json.dumps(tools or [], sort_keys=True, ensure_ascii=False))


def template_reads_tools(tokenizer: Any) -> bool:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = " ".join(str(v) for v in t.values())
    return isinstance(t, str) and "tools" in t and "tool_calls" in t


class ChatRenderer:
    """Messages (+ tools) to token ids through the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, tool_prompt: str = "auto") -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise BadRequestError("the tokenizer has no chat template: use /v1/completions or prompt_token_ids")
        self.tokenizer = tokenizer
        self.native_tools = tool_prompt == "native" or (tool_prompt == "auto" and template_reads_tools(tokenizer))
        self._tails: dict[str, str | None] = {}

    # -- messages as the template sees them -------------------------------------------------------
    def template_messages(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            role = "system" if m["role"] == "developer" else m["role"]
            t: dict[str, Any] = {"role": role, "content": m["content"]}
            if m.get("tool_calls"):
                if self.native_tools:
                    t["tool_calls"] = [
                        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in m["tool_calls"]
                    ]
                else:
                    calls = "\n".join(format_tool_call(c["name"], c["arguments"]) for c in m["tool_calls"])
                    t["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
            for k in ("name", "tool_call_id"):
                if k in m and self.native_tools:
                    t[k] = m[k]
            out.append(t)
        if tools and not self.native_tools:
            block = tools_system_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *, add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                self.template_messages(messages, tools),
                tools=tools if (tools and self.native_tools) else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception and template errors
            raise BadRequestError(f"the chat template cannot render these messages: {e}", param="messages") from e
        return str(text)

    def turn_tail(
        self, messages_before: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, *, cached: bool = False
    ) -> str | None:
        """The text the template writes after an assistant message's content (``<|im_end|>\\n`` for
        ChatML), or None when it cannot be told. ``cached``: reuse the tail last computed for these
        tools (the caller verifies it against the rendered text and asks again uncached if it fails)."""
        key = tools_key(tools)
        if cached:
            hit = self._tails.get(key, _SENTINEL)  # dict ops are atomic: safe across threads
            if hit is not _SENTINEL:
                return hit
        text = self.render([*messages_before, {"role": "assistant", "content": _SENTINEL}], tools, add_generation_prompt=False)
        i = text.rfind(_SENTINEL)
        tail = None if i < 0 else text[i + len(_SENTINEL) :]
        if len(self._tails) > 256:
            self._tails.clear()
        self._tails[key] = tail
        return tail

    # -- tokens -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
