"""The white-box agent's client: a session bound to an in-process ``Gateway``.

It calls the same core methods the HTTP routes call (``Gateway.start_chat`` ...), so a white-box
call is validated, stitched, routed and recorded exactly like a black-box one -- only without HTTP.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arborl.gateway.sessions import SessionInfo
from arborl.types import EpisodeStatus

if TYPE_CHECKING:
    from arborl.gateway.core import Gateway


@dataclass
class ChatReply:
    """One chat call's answer, shaped for an agent loop."""

    message: dict[str, Any]  # the assistant message, ready to append to the conversation
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI tool calls: {"id", "type", "function": {"name", "arguments"}}
    finish_reason: str
    call_id: str  # the recorded call (attach step rewards to it)
    token_ids: list[int]  # completion token ids, as the engine produced them
    policy_version: int | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)  # the full OpenAI response body

    @classmethod
    def from_response(cls, raw: dict[str, Any]) -> "ChatReply":
        """The reply of a one-choice ``/v1/chat/completions`` response body."""
        ch = raw["choices"][0]
        msg = ch["message"]
        return cls(message=msg, content=msg.get("content"), tool_calls=list(msg.get("tool_calls") or []),
                   finish_reason=ch["finish_reason"], call_id=ch["call_id"], token_ids=ch["token_ids"],
                   policy_version=ch["policy_version"], raw=raw)


class ChatMixin(ABC):
    """``chat`` over a client's ``chat_completion`` (one body, whichever way it reaches the gateway)."""

    model: str

    @abstractmethod
    async def chat_completion(self, **body: Any) -> dict[str, Any]:
        """The raw ``/v1/chat/completions`` body in, the OpenAI response body out (non-streaming)."""

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **params: Any) -> ChatReply:
        """One chat completion (``n`` must be 1); ``params`` are OpenAI's (temperature, max_tokens, stop, ...)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, **params, "return_token_ids": True}
        if tools:
            body["tools"] = tools
        raw = await self.chat_completion(**body)
        if len(raw["choices"]) != 1:
            raise ValueError(f"{type(self).__name__}.chat serves one choice; use chat_completion(n=...) for several")
        return ChatReply.from_response(raw)


class SessionClient(ChatMixin):
    """A session-bound client for white-box agents (see ``agents.base.AgentLoop``)."""

    def __init__(self, gateway: Gateway, info: SessionInfo) -> None:
        self.gateway = gateway
        self.session = info.session
        self.api_key = info.api_key  # the same key a black-box agent would get
        self.harness_key = info.harness_key  # rewards over HTTP (a rollout worker's); never handed to a program

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def model(self) -> str:
        return self.gateway.model_name

    @contextlib.asynccontextmanager
    async def gateway_socket(self) -> AsyncIterator[Path]:
        """The gateway on a Unix socket while inside (for an agent in a sandbox with no network)."""
        from arborl.agents.served import serve_unix

        async with serve_unix(self.gateway) as path:
            yield path

    async def chat_completion(self, **body: Any) -> dict[str, Any]:
        """The raw ``/v1/chat/completions`` body in, the OpenAI response body out (non-streaming)."""
        return await self.gateway.chat_completion(self.session, body)

    async def completion(self, **body: Any) -> dict[str, Any]:
        """``/v1/completions`` in-process (text or token prompts)."""
        return await self.gateway.completion(self.session, body)

    async def reward(self, value: float, *, name: str = "agent", call_id: str | None = None) -> None:
        """A step / process reward, optionally attached to a call."""
        await self.gateway.add_reward(self.session, value, name=name, call_id=call_id)

    async def interaction(self, **record: Any) -> None:
        """Record an environment interaction (a tool run, an observation) on the episode."""
        await self.gateway.add_interaction(self.session, record)

    async def finish(self, status: EpisodeStatus | str = EpisodeStatus.FINISHED) -> None:
        await self.gateway.finish(self.session, status)

    async def trajectory(self) -> dict[str, Any]:
        return await self.gateway.trajectory(self.session)
