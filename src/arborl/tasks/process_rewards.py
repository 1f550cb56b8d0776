"""Process rewards a built-in task emits while its agent runs (C1, Forge's examples): a malformed tool
call, a tool error, language mixing (text in another script in an English task).

They travel the path every agent's step rewards take: ``client.reward(value, call_id=...)`` ->
``Gateway.add_reward`` -> ``episode.meta["rewards"]`` (a black-box agent posts the same record to
``POST /v1/sessions/{id}/reward``) -> ``train/samples.py`` puts each on the turn of the call it names,
where ``train.advantage.shaping.process_weight`` weighs it. :class:`RewardingAgent` wraps any agent
loop: it watches the client's replies and tool interactions and posts the penalties, so the loop
itself needs no change.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

from arborl.agents import AgentLoop, AgentOutcome
from arborl.agents.client import ChatReply, SessionClient
from arborl.gateway.toolcalls import OPEN
from arborl.types import Task


@dataclass(frozen=True)
class ProcessRewardRules:
    """Reward per event (reward units; 0 turns a rule off)."""

    malformed_tool_call: float = -0.2  # a <tool_call> block the gateway could not parse (left in the content)
    tool_error: float = -0.2  # the tool answered with an error (bad expression, unknown tool, bad arguments)
    language_mixing: float = -0.2  # letters of a non-Latin script in a reply to an English task


def malformed_tool_calls(content: str | None) -> int:
    """Tool-call blocks left in a reply's content: the gateway parses well-formed ones out of it."""
    return (content or "").count(OPEN)


def other_script_letters(text: str | None) -> int:
    """Letters outside the Latin script (Cyrillic, CJK, Arabic, ...); accented Latin letters, digits,
    punctuation and symbols do not count."""
    n = 0
    for ch in text or "":
        if ord(ch) > 127 and ch.isalpha() and not unicodedata.name(ch, "").startswith("LATIN"):
            n += 1
    return n


def reply_penalties(reply: ChatReply, rules: ProcessRewardRules) -> list[tuple[str, float]]:
    """The (name, value) process rewards one model reply earns."""
    out = []
    if rules.malformed_tool_call and malformed_tool_calls(reply.content):
        out.append(("malformed_tool_call", rules.malformed_tool_call))
    if rules.language_mixing and other_script_letters(reply.content):
        out.append(("language_mixing", rules.language_mixing))
    return out


class RewardingClient:
    """A session client that posts the process rewards of what passes through it (on the call they
    belong to); everything else is the wrapped client's."""

    def __init__(self, client: SessionClient, rules: ProcessRewardRules) -> None:
        self.client = client
        self.rules = rules

    async def chat(self, messages: list[dict[str, Any]], **kw: Any) -> ChatReply:
        reply = await self.client.chat(messages, **kw)
        for name, value in reply_penalties(reply, self.rules):
            await self.client.reward(value, name=name, call_id=reply.call_id)
        return reply

    async def interaction(self, **record: Any) -> None:
        await self.client.interaction(**record)
        if record.get("error") and self.rules.tool_error:
            await self.client.reward(self.rules.tool_error, name="tool_error", call_id=record.get("call_id"))

    def __getattr__(self, attr: str) -> Any:
        if attr in ("client", "rules"):
            raise AttributeError(attr)
        return getattr(self.client, attr)


class RewardingAgent:
    """``agent`` run through a :class:`RewardingClient`."""

    def __init__(self, agent: AgentLoop, rules: ProcessRewardRules | None = None) -> None:
        self.agent = agent
        self.rules = rules or ProcessRewardRules()

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome | None:
        return await self.agent(task, RewardingClient(client, self.rules))  # type: ignore[arg-type]
