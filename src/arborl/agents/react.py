"""A built-in ReAct-style tool agent (a white-box loop, A1): ask the model, run the tools it calls, feed the results back,
until it answers without a tool call (or ``max_turns``).

Tools are Python functions (sync or async) taking the call's arguments as keyword arguments and
returning something printable. A bad call (unknown tool, arguments that are not a JSON object,
an exception in the tool) is answered with an ``error: ...`` tool message -- environment feedback,
never a crash of the episode. Each tool run is recorded as an interaction of the episode.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from arborl.agents.base import AgentOutcome
from arborl.agents.client import SessionClient
from arborl.types import Task


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def spec(self) -> dict[str, Any]:
        """The OpenAI tool spec."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def task_messages(task: Task, system_prompt: str | None = None) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if isinstance(task.prompt, str):
        msgs.append({"role": "user", "content": task.prompt})
    else:
        msgs.extend(dict(m) for m in task.prompt)
    return msgs


class ReActAgent:
    """``await ReActAgent(tools)(task, client)`` -> AgentOutcome(answer=final content)."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        system_prompt: str | None = None,
        max_turns: int = 8,
        max_tool_output_chars: int = 4000,
        **sampling: Any,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.max_tool_output_chars = max_tool_output_chars
        self.sampling = sampling  # OpenAI params for every call: temperature, max_tokens, ...

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome:
        messages = task_messages(task, self.system_prompt)
        specs = [t.spec() for t in self.tools.values()] or None
        tool_runs = 0
        for turn in range(self.max_turns):
            reply = await client.chat(messages, tools=specs, **self.sampling)
            messages.append(reply.message)
            if not reply.tool_calls:
                return AgentOutcome(answer=reply.content, info={"turns": turn + 1, "tool_runs": tool_runs,
                                                                "finish_reason": reply.finish_reason})
            for tc in reply.tool_calls:
                name, raw_args = tc["function"]["name"], tc["function"]["arguments"]
                result, error = await self._run(name, raw_args)
                tool_runs += 1
                await client.interaction(kind="tool", call_id=reply.call_id, tool=name, arguments=raw_args,
                                         result=result, error=error)
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
        return AgentOutcome(answer=None, info={"turns": self.max_turns, "tool_runs": tool_runs, "stopped": "max_turns"})

    async def _run(self, name: str, raw_args: str) -> tuple[str, str | None]:
        tool = self.tools.get(name)
        if tool is None:
            err = f"unknown tool {name!r}; available: {', '.join(self.tools)}"
            return f"error: {err}", err
        try:
            args = json.loads(raw_args) if raw_args.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            out = tool.fn(**args)
            if inspect.isawaitable(out):
                out = await out
        except Exception as e:  # noqa: BLE001 - tool failures are observations
            err = f"{type(e).__name__}: {e}"
            return f"error: {err}", err
        text = out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)
        return text[: self.max_tool_output_chars], None
