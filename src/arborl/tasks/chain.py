"""A multi-turn task where credit assignment matters: a chain of dependent steps, one model call each,
where a wrong step ends the episode (every later step depends on it), so the outcome says only *that*
something went wrong, never *where*. Each correct step earns a process reward on its own call (C1).

Two suites share the loop:

* ``chain`` (a real model): "Start with 7. Step 1: add 5. Step 2: multiply by 3. ..." -- each step is
  one ``calculator`` tool call whose expression must evaluate to the running value after that step
  (so step k needs step k-1's result); after the last step the model answers ``Answer: <number>``.
  Steps = ``rollout.max_turns - 1``. Malformed tool calls, tool errors and language mixing are
  penalised too (``tasks/process_rewards.py``).
* ``chain_tokens`` (tiny random models, the credit benchmark): the same episode shape on token ids:
  a step is right when the reply's first generated token has an even id; steps = ``rollout.max_turns``.
  A random policy finishes a chain of K steps with probability 2^-K, so outcome-only groups are mostly
  all-zero while every step still carries its own signal.

Outcome 1 when every step (and for ``chain`` the final answer) is right, else 0.
"""

from __future__ import annotations

import json
import random
from typing import Any

from arborl.agents import AgentLoop, AgentOutcome
from arborl.agents.client import SessionClient
from arborl.agents.react import task_messages
from arborl.tasks.calculator import TOOL_SCHEMA, CalculatorError, evaluate, extract_answer, format_number
from arborl.tasks.process_rewards import ProcessRewardRules, RewardingClient
from arborl.types import Call, Task

SYSTEM_PROMPT = (
    "You follow a chain of arithmetic steps with a calculator tool, one tool call per step, each on the "
    "previous result. To use it, reply with exactly\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<expression>"}}</tool_call>\n'
    "After the last step give the final answer as: Answer: <number>"
)
EXAMPLE = [
    {"role": "user", "content": "Start with 4. Step 1: add 3. Step 2: multiply by 2."},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "4 + 3"}}</tool_call>'},
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 2"}}</tool_call>'},
    {"role": "tool", "content": "14"},
    {"role": "assistant", "content": "Answer: 14"},
]
_SPLIT_SEED = {"train": 5_000_011, "eval": 6_000_011}
_OPS = [("add", "+"), ("subtract", "-"), ("multiply by", "*")]


def make_chain(rng: random.Random, steps: int) -> tuple[int, list[tuple[str, int]], list[str]]:
    """(start, [(operator, operand)], the running value after each step as text)."""
    start = rng.randint(2, 20)
    ops, values, v = [], [], float(start)
    for _ in range(steps):
        word, op = rng.choice(_OPS)
        x = rng.randint(2, 5) if op == "*" else rng.randint(1, 20)
        ops.append((op, x))
        v = evaluate(f"{format_number(v)} {op} {x}")
        values.append(format_number(v))
    return start, ops, values


def step_is_right(reply_tool_calls: list[dict[str, Any]], expected: str) -> bool:
    """One calculator call whose expression evaluates to the expected running value."""
    if len(reply_tool_calls) != 1 or reply_tool_calls[0]["function"]["name"] != "calculator":
        return False
    try:
        args = json.loads(reply_tool_calls[0]["function"]["arguments"] or "{}")
        return format_number(evaluate(str(args["expression"]))) == expected
    except (CalculatorError, KeyError, TypeError, ValueError):
        return False


class ChainAgent:
    """The chain loop: one call per step, a wrong step ends the episode; +step_reward on each right step."""

    def __init__(self, *, steps: int, tokens: bool, step_reward: float, rules: ProcessRewardRules,
                 sampling: dict[str, Any]) -> None:
        self.steps, self.tokens, self.step_reward, self.rules, self.sampling = steps, tokens, step_reward, rules, sampling

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome:
        client = RewardingClient(client, self.rules)  # type: ignore[assignment]
        tools = None if self.tokens else [TOOL_SCHEMA]
        messages = task_messages(task, None if self.tokens else SYSTEM_PROMPT)
        expected = task.metadata["values"]
        for k in range(self.steps):
            reply = await client.chat(messages, tools=tools, **self.sampling)
            messages.append(reply.message)
            right = (bool(reply.token_ids) and reply.token_ids[0] % 2 == 0) if self.tokens else \
                step_is_right(reply.tool_calls, expected[k])
            if not right:
                return AgentOutcome(answer=None, info={"steps_right": k, "turns": k + 1})
            await client.reward(self.step_reward, name="step_right", call_id=reply.call_id)
            if self.tokens:
                messages.append({"role": "user", "content": f"Step {k + 2} of {self.steps}."})
            else:
                messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": expected[k]})
                await client.interaction(kind="tool", call_id=reply.call_id, tool="calculator", result=expected[k])
        if self.tokens:
            return AgentOutcome(answer="done", info={"steps_right": self.steps, "turns": self.steps})
        reply = await client.chat(messages, tools=tools, **self.sampling)
        return AgentOutcome(answer=reply.content, info={"steps_right": self.steps, "turns": self.steps + 1})


class ChainSuite:
    """``chain`` / ``chain_tokens``: see the module docstring."""

    def __init__(self, *, steps: int = 2, tokens: bool = False, step_reward: float = 0.2,
                 in_context_example: bool = True, process_rules: ProcessRewardRules | None = None) -> None:
        if steps < 1:
            raise ValueError(f"a chain needs at least one step, got {steps}")
        self.name = "chain_tokens" if tokens else "chain"
        self.steps, self.tokens, self.step_reward = steps, tokens, step_reward
        self.in_context_example = in_context_example
        self.process_rules = process_rules or ProcessRewardRules()

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if split not in _SPLIT_SEED:
            raise ValueError(f"split must be one of {sorted(_SPLIT_SEED)}, got {split!r}")
        rng = random.Random(_SPLIT_SEED[split] + seed)
        out = []
        for i in range(n):
            start, ops, values = make_chain(rng, self.steps)
            if self.tokens:
                prompt: Any = f"Chain {i}: step 1 of {self.steps}."
            else:
                words = {"+": "add", "-": "subtract", "*": "multiply by"}
                text = f"Start with {start}. " + " ".join(f"Step {k + 1}: {words[o]} {x}." for k, (o, x) in enumerate(ops))
                prompt = ([*EXAMPLE] if self.in_context_example else []) + [{"role": "user", "content": text}]
            out.append(Task(task_id=f"{self.name}-{split}-{seed}-{i}", prompt=prompt, split=split,
                            metadata={"answer": values[-1], "values": values}))
        return out

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        return ChainAgent(steps=self.steps, tokens=self.tokens, step_reward=self.step_reward,
                          rules=self.process_rules, sampling=sampling)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        steps_right = float(outcome.info.get("steps_right", 0)) if outcome is not None else 0.0
        done = steps_right == self.steps
        if not self.tokens:
            done = done and outcome is not None and extract_answer(outcome.answer or "") == task.metadata["answer"]
        return {"outcome": float(done), "steps_right": steps_right / self.steps}
