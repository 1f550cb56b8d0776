"""Tool calls in model output: parse them into OpenAI ``tool_calls``, and write them back as text.

The convention (SmolLM2 / Qwen / Hermes style) is one block per call::

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

An unclosed last block (the model stopped, or a stop string cut ``</tool_call>``) is parsed too.
Without any ``<tool_call>`` marker, an output that is *only* a JSON object (or a list of objects)
shaped like ``{"name": ..., "arguments": {...}}`` -- optionally in a ```json fence -- is taken as
tool calls (the JSON fallback). A block that is not valid JSON, lacks a name, names a tool the
request did not offer, or whose arguments are not an object is *malformed*: it stays in the
content as text and its reason is returned in ``errors`` (the gateway counts it on the call).
Parsing never raises.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None  # text outside the parsed calls, stripped; None when empty
    tool_calls: list[ToolCall]
    errors: list[str]  # one reason per malformed tool call (left in content)


def _call_from_obj(obj: Any, tool_names: Collection[str] | None) -> ToolCall | str:
    """A ToolCall, or the reason ``obj`` is not a valid one."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI-shaped
        obj = obj["function"]
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a non-empty string 'name'"
    if tool_names is not None and name not in tool_names:
        return f"unknown tool {name!r} (offered: {', '.join(sorted(tool_names)) or 'none'})"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"tool {name!r}: arguments string is not valid JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"tool {name!r}: arguments must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _parse_blocks(text: str, tool_names: Collection[str] | None) -> ParsedOutput:
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        body = m.group(1).strip()
        try:
            got: ToolCall | str = _call_from_obj(json.loads(body), tool_names)
        except json.JSONDecodeError as e:
            got = f"tool call is not valid JSON: {e.msg} at char {e.pos}"
        if isinstance(got, ToolCall):
            calls.append(got)
            kept.append(text[pos : m.start()])
        else:
            errors.append(got)
            kept.append(text[pos : m.end()])  # malformed: stays as text
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return ParsedOutput(content or None, calls, errors)


def _parse_json_fallback(text: str, tool_names: Collection[str] | None) -> ParsedOutput | None:
    s = text.strip()
    fence = _FENCE.match(s)
    if fence:
        s = fence.group(1)
    if not s.startswith(("{", "[")):
        return None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        if s.startswith("{") and '"name"' in s:  # looks like an attempted call
            return ParsedOutput(text.strip() or None, [], [f"tool call is not valid JSON: {e.msg} at char {e.pos}"])
        return None
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(isinstance(i, dict) and ("name" in i or "function" in i) for i in items):
        return None  # a JSON answer, not a tool call
    got = [_call_from_obj(i, tool_names) for i in items]
    errors = [g for g in got if isinstance(g, str)]
    if errors:
        return ParsedOutput(text.strip() or None, [], errors)
    return ParsedOutput(None, [g for g in got if isinstance(g, ToolCall)], [])


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> ParsedOutput:
    """Split model output ``text`` into content and tool calls (see the module docstring)."""
    if OPEN in text:
        return _parse_blocks(text, tool_names)
    fallback = _parse_json_fallback(text, tool_names)
    if fallback is not None:
        return fallback
    return ParsedOutput(text.strip() or None, [], [])


def markup_start(text: str) -> int | None:
    """Where tool-call markup may begin in a still-growing ``text``: the first ``<tool_call>``, or
    a tail that is a proper prefix of it. Streaming holds text from there back until the end."""
    i = text.find(OPEN)
    if i >= 0:
        return i
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return None


def format_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """The text of one call in the ``<tool_call>`` convention (how a past call is shown to the model)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the agent's string as it is
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """System-prompt text offering ``tools`` (OpenAI tool specs) in the ``<tool_call>`` convention,
    for chat templates that ignore ``tools``."""
    lines = [json.dumps(t.get("function", t), ensure_ascii=False, sort_keys=True) for t in tools]
    return (
        "You may call one or more tools to help with the request. The tools, as JSON schemas:\n"
        "<tools>\n" + "\n".join(lines) + "\n</tools>\n"
        "To call a tool, write a JSON object with the tool's name and arguments inside tags, one call per "
        'block: <tool_call>{"name": <tool-name>, "arguments": <args-json-object>}</tool_call>'
    )
