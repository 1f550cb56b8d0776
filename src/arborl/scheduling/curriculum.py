"""Curriculum by a task attribute (code_repair's ``tier``, a dataset's ``level`` column, ...): the task stream
starts with the easiest value only and unlocks the next one every ``steps`` training steps (scheduling.curriculum*).

A task whose attribute is missing or not listed counts as harder than every listed value: it is drawn once
all of them are unlocked. Only what is drawn for training changes; evaluation is never filtered."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from arborl.types import ArborlError


class CurriculumError(ArborlError):
    """The train stream holds no task the curriculum's current stage admits."""


class Curriculum:
    def __init__(self, key: str, order: Sequence[Any], steps: int) -> None:
        if not key or not order:
            raise ValueError("a curriculum needs a metadata key and its values in order of difficulty")
        if steps < 1:
            raise ValueError(f"curriculum steps must be >= 1, got {steps}")
        self.key = key
        self.order = [str(v) for v in order]
        self.steps = steps
        self.skipped = 0  # tasks of the stream passed over because their value was still locked

    def stage(self, step: int) -> int:
        """Values unlocked at training step ``step`` (0-based), minus one: stage k admits ``order[:k + 1]``. The
        clock is the step, not the task stream: passing over locked tasks must not unlock the next value."""
        return min(step // self.steps, len(self.order))

    def rank(self, metadata: Mapping[str, Any]) -> int:
        value = metadata.get(self.key)
        return self.order.index(str(value)) if value is not None and str(value) in self.order else len(self.order)

    def admits(self, metadata: Mapping[str, Any], step: int) -> bool:
        ok = self.rank(metadata) <= self.stage(step)
        if not ok:
            self.skipped += 1
        return ok

    def unlocked(self, step: int) -> list[str]:
        return self.order[: self.stage(step) + 1]
