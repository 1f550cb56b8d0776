"""Reward functions of the dataset task suite (``rollout.data.reward_function``).

A reward function scores one finished episode::

    def my_reward(task: Task, completion: str, calls: list[Call], answer: Any) -> float | dict[str, float]

``completion`` is the agent's final answer (the last reply's text; "" when there is none), ``calls``
the episode's recorded model calls (token ids, log-probs), ``answer`` the row's
``rollout.data.answer_key`` column (None when that knob is null); ``task.metadata`` holds every
column of the row but the prompt. It returns the outcome reward, or a dict of reward components
that holds ``"outcome"`` (what GRPO trains on; the others are logged with the episode). Built-in:
``exact_match``. Anything else it returns, a NaN or an exception inside it, is a
``RewardFunctionError`` naming the function and the task.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Protocol

from arborl.registry import Registry, RegistryError
from arborl.types import ArborlError, Call, Task

from arborl.tasks.data_files import DatasetError


class RewardFunctionError(ArborlError, ValueError):
    """A reward function raised, or returned something that is not a reward; the message says what to fix."""


class RewardFunction(Protocol):
    def __call__(self, task: Task, completion: str, calls: list[Call], answer: Any) -> float | Mapping[str, float]: ...


REWARD_FUNCTIONS: Registry[RewardFunction] = Registry("reward function")


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(task: Task, completion: str, calls: list[Call], answer: Any) -> float:
    """1.0 when the completion, stripped, equals ``str(answer)`` stripped; else 0.0."""
    return 1.0 if answer is not None and completion.strip() == str(answer).strip() else 0.0


def _number(value: Any, what: str) -> float:
    if isinstance(value, numbers.Real):
        x = float(value)
        if math.isfinite(x):
            return x
    raise ValueError(f"{what} is {value!r}, not a finite number")


def reward_components(value: Any) -> dict[str, float]:
    """A reward function's return value as reward components; ValueError when it is not one."""
    if isinstance(value, Mapping):
        if "outcome" not in value:
            raise ValueError(f"the dict it returned has no 'outcome' (keys: {', '.join(map(str, value)) or 'none'})")
        return {str(k): _number(v, f"component {k!r}") for k, v in value.items()}
    if isinstance(value, numbers.Real):
        return {"outcome": _number(value, "the reward")}
    raise ValueError(f"it returned {type(value).__name__} {value!r:.80}")


class LoadedRewardFunction:
    """The function ``spec`` names, called with its return value checked."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        try:
            fn = REWARD_FUNCTIONS.get(spec)
        except RegistryError as e:
            raise DatasetError(f"rollout.data.reward_function: {e}") from None
        if not callable(fn):
            raise DatasetError(f"rollout.data.reward_function: {spec!r} is a {type(fn).__name__}, not a function")
        self.fn = fn

    def __call__(self, task: Task, completion: str, calls: list[Call], answer: Any) -> dict[str, float]:
        try:
            value = self.fn(task, completion, calls, answer)
        except Exception as e:  # noqa: BLE001 - named and re-raised
            raise RewardFunctionError(f"reward function {self.spec} raised on task {task.task_id}: {e!r}") from e
        try:
            return reward_components(value)
        except ValueError as e:
            raise RewardFunctionError(
                f"reward function {self.spec} on task {task.task_id}: {e}; return a float, or a dict of floats "
                "holding 'outcome'"
            ) from None
