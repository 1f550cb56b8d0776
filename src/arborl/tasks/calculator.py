"""Calculator tool use: arithmetic questions at several difficulty levels, a ``calculator`` tool the
environment executes, reward 1 for a correct final answer, and process rewards (C1) on the turn that
earned them: a malformed tool call, a tool error, language mixing (``tasks/process_rewards.py``).

Everything is generated from a seed (no data files): ``make_tasks(split, n, seed)``. The train and
eval splits draw from disjoint seeds so held-out questions are never trained on.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any, Callable

from arborl.agents import AgentLoop, AgentOutcome, ReActAgent, Tool
from arborl.tasks.process_rewards import ProcessRewardRules, RewardingAgent
from arborl.types import Call, Task

TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+7)*3"}},
            "required": ["expression"],
        },
    },
}

SYSTEM_PROMPT = (
    "You solve arithmetic questions with a calculator tool. To use it, reply with exactly\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<expression>"}}</tool_call>\n'
    "The tool replies with the result. Then give the final answer as: Answer: <number>"
)

# one worked example, as chat turns (the in-context example the default job uses)
EXAMPLE = [
    {"role": "user", "content": "What is 12 * 7 + 5?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7 + 5"}}</tool_call>'},
    {"role": "tool", "content": "89"},
    {"role": "assistant", "content": "Answer: 89"},
]

_SPLIT_SEED = {"train": 1_000_003, "eval": 2_000_003}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic (the message goes back to the model as the tool result)."""


def evaluate(expression: str) -> float:
    """Safely evaluate + - * / ( ) on numbers; anything else raises CalculatorError."""
    if len(expression) > 200:
        raise CalculatorError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from e

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise CalculatorError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        raise CalculatorError(f"unsupported syntax in {expression!r}: use numbers, + - * / and parentheses")

    return ev(tree)


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4f}".rstrip("0").rstrip(".")


def run_tool(arguments: str | dict) -> str:
    """Execute a calculator call; errors come back as text so the episode goes on."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        expression = args["expression"]
        if not isinstance(expression, str):
            raise CalculatorError("expression must be a string")
        return format_number(evaluate(expression))
    except (CalculatorError, KeyError, TypeError, json.JSONDecodeError) as e:
        return f"error: {e}"


def _question(rng: random.Random, level: int) -> tuple[str, str]:
    if level == 1:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice(["+", "-"])
        expr = f"{a} {op} {b}"
    elif level == 2:
        a, b = rng.randint(11, 99), rng.randint(3, 29)
        expr = f"{a} * {b}"
    else:
        a, b, c = rng.randint(11, 99), rng.randint(3, 19), rng.randint(10, 99)
        expr = rng.choice([f"{a} * {b} + {c}", f"({a} + {c}) * {b}", f"{a} * {b} - {c}"])
    templates = [
        "What is {e}?",
        "Compute {e}.",
        "Calculate {e} and give the result.",
    ]
    return rng.choice(templates).format(e=expr), format_number(evaluate(expr))


def seeded_questions(
    prefix: str,
    question: Callable[[random.Random, int], tuple[str, str]],
    split_seeds: dict[str, int],
    split: str,
    n: int,
    seed: int,
    levels: tuple[int, ...],
) -> list[Task]:
    """``n`` tasks cycling through ``levels``, drawn from ``question(rng, level) -> (text, answer)``
    with a per-split seed base (disjoint splits); the prompt is the question text."""
    if split not in split_seeds:
        raise ValueError(f"split must be one of {sorted(split_seeds)}, got {split!r}")
    rng = random.Random(split_seeds[split] + seed)
    tasks = []
    for i in range(n):
        level = levels[i % len(levels)]
        q, answer = question(rng, level)
        tasks.append(Task(task_id=f"{prefix}-{split}-{seed}-{i}", prompt=q, metadata={"answer": answer, "level": level},
                          split=split))
    return tasks


def make_tasks(split: str, n: int, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3)) -> list[Task]:
    return seeded_questions("calc", _question, _SPLIT_SEED, split, n, seed, levels)


_ANSWER = re.compile(r"Answer:\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    m = _ANSWER.findall(text)
    if not m:
        return None
    try:
        return format_number(float(m[-1].replace(",", "")))
    except ValueError:
        return None


def score(task: Task, final_text: str) -> float:
    """1.0 when the final answer equals the task's answer, else 0.0."""
    return 1.0 if extract_answer(final_text) == task.metadata["answer"] else 0.0


class CalculatorSuite:
    """The task suite the default job trains on: a ReAct agent with the calculator tool and, by
    default, one worked example in the prompt (SmolLM2-135M-Instruct calls the tool only with it)."""

    name = "calculator"

    def __init__(self, *, in_context_example: bool = True, max_turns: int = 3, levels: tuple[int, ...] = (1, 2, 3),
                 process_rules: ProcessRewardRules | None = None):
        self.in_context_example = in_context_example
        self.max_turns = max_turns
        self.levels = levels
        self.process_rules = process_rules or ProcessRewardRules()

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        tasks = make_tasks(split, n, seed, self.levels)
        for t in tasks:
            prompt = [{"role": "user", "content": t.prompt}]
            t.prompt = (EXAMPLE + prompt) if self.in_context_example else prompt
        return tasks

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        tool = Tool(
            name="calculator",
            fn=lambda expression: run_tool({"expression": expression}),
            description=TOOL_SCHEMA["function"]["description"],
            parameters=TOOL_SCHEMA["function"]["parameters"],
        )
        agent = ReActAgent([tool], system_prompt=SYSTEM_PROMPT, max_turns=self.max_turns, **sampling)
        return RewardingAgent(agent, self.process_rules)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        answer = outcome.answer if outcome is not None and outcome.answer else ""
        used_tool = float(bool(outcome and outcome.info.get("tool_runs", 0)))
        return {"outcome": score(task, answer), "used_tool": used_tool}
