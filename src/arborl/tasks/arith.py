"""Single-turn arithmetic: one question, one model call, no tools; reward 1 when the reply ends
with the right ``Answer: <number>``.

This is the workload ``arborl bench vs-trl`` runs in both arborl and TRL, so everything a
framework needs to see the same job lives here, as plain data: ``prompt_messages(task)`` (the
chat messages, system prompt included, exactly what arborl's agent sends) and ``reward(answer, text)``
(the one scoring rule); the bench puts them in TRL's shape.

Tasks are generated from a seed (no data files); train and eval draw from disjoint seeds.
"""

from __future__ import annotations

import random
from typing import Any

from arborl.agents import AgentLoop, AgentOutcome, ReActAgent
from arborl.tasks.calculator import extract_answer, format_number, seeded_questions
from arborl.types import Call, Task

SYSTEM_PROMPT = "You are a calculator. Reply with the result only, as: Answer: <number>"

# worked examples put before the question (without them SmolLM2-135M never writes "Answer:")
EXAMPLE = [
    {"role": "user", "content": "What is 7 + 5?"},
    {"role": "assistant", "content": "Answer: 12"},
    {"role": "user", "content": "Compute 23 - 9."},
    {"role": "assistant", "content": "Answer: 14"},
]

_SPLIT_SEED = {"train": 3_000_017, "eval": 4_000_037}


def _question(rng: random.Random, level: int) -> tuple[str, str]:
    if level == 1:  # small sums: SmolLM2-135M gets many right
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        expr, value = f"{a} + {b}", a + b
    elif level == 2:  # two-digit sums and differences: some right
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice(["+", "-"])
        expr, value = f"{a} {op} {b}", (a + b if op == "+" else a - b)
    else:  # small products
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        expr, value = f"{a} * {b}", a * b
    template = rng.choice(["What is {e}?", "Compute {e}.", "{e} = ?"])
    return template.format(e=expr), format_number(value)


def make_tasks(split: str, n: int, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3)) -> list[Task]:
    tasks = seeded_questions("arith", _question, _SPLIT_SEED, split, n, seed, levels)
    for t in tasks:
        t.prompt = [*EXAMPLE, {"role": "user", "content": t.prompt}]
    return tasks


def prompt_messages(task: Task) -> list[dict[str, str]]:
    """The chat messages of ``task`` as the model sees them (system prompt first)."""
    prompt = task.prompt if isinstance(task.prompt, list) else [{"role": "user", "content": task.prompt}]
    return [{"role": "system", "content": SYSTEM_PROMPT}, *(dict(m) for m in prompt)]


def reward(answer: str, text: str | None) -> float:
    """1.0 when the last ``Answer: <number>`` in ``text`` equals ``answer``, else 0.0."""
    return 1.0 if text and extract_answer(text) == answer else 0.0


class ArithSuite:
    """One call per episode: the built-in ReAct agent with no tools and ``max_turns=1``."""

    name = "arith"

    def __init__(self, *, levels: tuple[int, ...] = (1, 2, 3)):
        self.levels = levels

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return make_tasks(split, n, seed, self.levels)

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        return ReActAgent([], system_prompt=SYSTEM_PROMPT, max_turns=1, **sampling)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        return {"outcome": reward(task.metadata["answer"], outcome.answer if outcome is not None else None)}
