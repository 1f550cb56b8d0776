"""The reward of the capitals example (rollout.data.reward_function=examples/capitals/reward.py:reward).

arborl calls it once per finished episode with the task (task.metadata holds the row's other
columns), the agent's final reply, the episode's recorded model calls and the row's answer column.
"""

from __future__ import annotations

from typing import Any

MAX_CHARS = 40  # a reply naming just the city fits easily
BRIEF_CREDIT = 0.2  # partial credit for a short wrong reply


def reward(task, completion: str, calls: list, answer: Any) -> dict[str, float]:
    """correct: the reply names the capital (case-insensitive); brief: it has at most MAX_CHARS
    characters. outcome, the reward GRPO trains on: 1.0 when correct, else BRIEF_CREDIT when brief,
    else 0.0. Every component is stored with the episode."""
    said = completion.strip().lower()
    correct = 1.0 if str(answer).lower() in said else 0.0
    brief = 1.0 if len(said) <= MAX_CHARS else 0.0
    return {"outcome": correct or BRIEF_CREDIT * brief, "correct": correct, "brief": brief}
