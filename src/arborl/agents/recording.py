"""Clients for white-box agents that run outside the gateway and keep the conversation as a transcript.

``RecordingClient`` has the part of ``SessionClient``'s interface an agent loop uses (``session_id``,
``chat``, ``interaction``, ``reward``); subclasses say where the assistant's messages come from:
``ScriptedClient`` replays messages a script chose (a scripted expert writing demonstrations),
``EndpointClient`` asks any OpenAI-compatible server (a stronger model to bootstrap from). The
transcript (``messages`` + ``tools``, OpenAI style) is what `arborl sft` trains on; the agent's tools
run exactly as in a recorded episode.
"""

from __future__ import annotations

import abc
import copy
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from arborl.agents.client import ChatReply


class RecordingClient(abc.ABC):
    """Base: ``await reply(messages, tools, params)`` -> the assistant message (OpenAI dict)."""

    def __init__(self, session_id: str | None = None) -> None:
        self.session_id = session_id or f"rec-{uuid.uuid4().hex[:12]}"
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.interactions: list[dict[str, Any]] = []
        self.rewards: list[tuple[str, float]] = []

    @abc.abstractmethod
    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    params: dict[str, Any]) -> dict[str, Any]:
        """The assistant message (an OpenAI dict) for ``messages``."""

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   **params: Any) -> ChatReply:
        msg = await self.reply(copy.deepcopy(messages), tools, params)
        msg = {"role": "assistant", "content": msg.get("content") or "", **{k: v for k, v in msg.items()
                                                                           if k == "tool_calls" and v}}
        self.messages = [*copy.deepcopy(messages), msg]
        self.tools = copy.deepcopy(tools)
        calls = list(msg.get("tool_calls") or [])
        return ChatReply(message=msg, content=msg["content"], tool_calls=calls,
                         finish_reason="tool_calls" if calls else "stop", call_id="", token_ids=[], policy_version=None)

    async def interaction(self, **record: Any) -> None:
        self.interactions.append(record)

    async def reward(self, value: float, *, name: str = "agent", call_id: str | None = None) -> None:
        self.rewards.append((name, value))

    def transcript(self) -> dict[str, Any]:
        """The conversation so far, ready for `arborl sft`: {"messages": [...], "tools": [...]}."""
        return {"messages": copy.deepcopy(self.messages), "tools": copy.deepcopy(self.tools) or []}


def tool_call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ScriptedClient(RecordingClient):
    """Answers with the messages ``script(messages, turn)`` returns (an assistant message dict)."""

    def __init__(self, script: Callable[[list[dict[str, Any]], int], dict[str, Any]], session_id: str | None = None) -> None:
        super().__init__(session_id)
        self.script = script
        self.turn = 0

    async def reply(self, messages, tools, params):
        out = self.script(messages, self.turn)
        self.turn += 1
        return out


class EndpointClient(RecordingClient):
    """Asks an OpenAI-compatible ``base_url`` (ending in /v1) for each assistant message."""

    def __init__(self, base_url: str, model: str, api_key: str = "none", *, timeout_s: float = 600.0,
                 session_id: str | None = None, http: httpx.AsyncClient | None = None) -> None:
        super().__init__(session_id)
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.http = http or httpx.AsyncClient(timeout=timeout_s)
        self._own = http is None

    async def reply(self, messages, tools, params):
        body = {"model": self.model, "messages": messages, **{k: v for k, v in params.items() if v is not None}}
        if tools:
            body["tools"] = tools
        r = await self.http.post(self.url, json=body, headers=self.headers)
        r.raise_for_status()
        return dict(r.json()["choices"][0]["message"])

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()
