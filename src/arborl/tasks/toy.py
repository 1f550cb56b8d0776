"""A trivially learnable suite for smoke tests with tiny random models: the reward is the fraction
of generated tokens with an even id. Any policy-gradient method should raise it within a few steps."""

from __future__ import annotations

from typing import Any

from arborl.agents import AgentLoop, AgentOutcome, ReActAgent
from arborl.types import Call, Task


class EvenTokensSuite:
    name = "even_tokens"

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        base = 0 if split == "train" else 10_000
        return [Task(task_id=f"even-{split}-{seed}-{i}", prompt=f"Say something ({base + seed * n + i}).", split=split)
                for i in range(n)]

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        return ReActAgent([], max_turns=1, **sampling)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        toks = [t for c in calls for t in c.completion_token_ids]
        return {"outcome": sum(1 for t in toks if t % 2 == 0) / len(toks) if toks else 0.0}
