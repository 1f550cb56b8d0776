"""Difficulty-aware dynamic sampling (DAPO's dynamic sampling, ROLL's prompt filtering): the ``dynamic``
consumption policy (``scheduling.consume=dynamic``; off by default).

A GRPO group whose members all got the same reward (all pass, all fail) has zero advantage
everywhere: training on it spends a step's compute on nothing. ``DynamicSampling`` is ``sync`` with
three changes:

* a finished group whose rewards are all equal is dropped (reason ``all_equal``), never trained;
* it keeps starting groups until the step has B groups with a learning signal, over-drawing up to
  ``max_draws`` x B groups per step; when that budget is spent it trains the useful groups it has (a
  short batch, counted) rather than wait forever;
* per-task pass-rate estimates: the recent groups of each task (its base id; ``x~1`` is ``x``). A task
  whose last ``skip_after`` groups were all all-pass or all-fail is skipped when drawn (``admit``) and
  its oldest record is forgotten, so it is tried again after ``skip_after`` skips (down-weighted, never
  banned).

Counts in the step metrics (cumulative): ``sched/all_equal_groups`` (dropped), ``sched/overdrawn_groups``
(groups started beyond B), ``sched/skipped_tasks``, ``sched/short_batches``. The controller reports
each finished group's rewards through ``on_rewards`` and asks ``admit`` before starting a drawn task.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Sequence

from arborl.scheduling.consume import CONSUME_POLICIES, SampleFilter, SyncConsume
from arborl.scheduling.policies import Batch

if TYPE_CHECKING:
    from arborl.config import SchedulingConfig


class DynamicSampling(SyncConsume):
    name = "dynamic"

    def __init__(self, batch_size: int, *, max_draws: float = 3.0, skip_after: int = 2, tol: float = 1e-6,
                 filters: Sequence[SampleFilter] = (), version: int = 0) -> None:
        if max_draws < 1:
            raise ValueError(f"max_draws must be >= 1 (batches per step), got {max_draws}")
        if skip_after < 0:
            raise ValueError(f"skip_after must be >= 0, got {skip_after}")
        super().__init__(batch_size, filters=filters, version=version)
        self.max_started = math.ceil(max_draws * batch_size - 1e-9)
        self.skip_after = skip_after
        self.tol = tol
        self._started_now = 0  # groups started for the step being formed
        self._equal: set[str] = set()
        self.history: dict[str, deque[float]] = {}  # task -> pass rates of its recent groups
        self.counts.update(all_equal_groups=0, overdrawn_groups=0, skipped_tasks=0, short_batches=0)

    # -- what the controller tells it --------------------------------------------------------------
    def on_rewards(self, item_id: str, task_id: str, rewards: Sequence[float]) -> None:
        """The rewards of a finished group (before ``on_finish``)."""
        if rewards and max(rewards) - min(rewards) <= self.tol:
            self._equal.add(item_id)
        if self.skip_after:
            rate = sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else 0.0
            self.history.setdefault(task_id.split("~")[0], deque(maxlen=self.skip_after)).append(rate)

    def admit(self, task_id: str) -> bool:
        """False: skip this task now (its recent groups were all all-pass or all-fail)."""
        h = self.history.get(task_id.split("~")[0])
        if not self.skip_after or h is None or len(h) < self.skip_after or any(0.0 < r < 1.0 for r in h):
            return True
        h.popleft()  # forget the oldest: the task comes back after skip_after skips
        self.counts["skipped_tasks"] += 1
        return False

    def pass_rates(self) -> dict[str, float]:
        """Each task's pass-rate estimate: the mean over its recent groups."""
        return {t: sum(h) / len(h) for t, h in self.history.items() if h}

    def snapshot(self) -> dict:
        return {**super().snapshot(), "started_now": self._started_now,
                "history": {t: list(h) for t, h in self.history.items()}}

    def restore(self, snap: dict) -> list[str]:
        self._started_now = snap.get("started_now", 0)
        for t, h in snap.get("history", {}).items():
            self.history[t] = deque(h, maxlen=self.skip_after)
        return super().restore(snap)

    # -- the policy --------------------------------------------------------------------------------
    def can_start(self) -> bool:
        return (self._taken == self.version and len(self._forming) + self._open < self._cap
                and self._started_now < self.max_started)

    def on_start(self, item_id: str) -> int:
        self._started_now += 1
        if self._started_now > self.batch_size:
            self.counts["overdrawn_groups"] += 1
        return super().on_start(item_id)

    def _reject(self, it) -> str | None:
        if it.item_id in self._equal:
            self._equal.discard(it.item_id)
            self.counts["all_equal_groups"] += 1
            return "all_equal"
        return super()._reject(it)

    def take_batch(self) -> Batch | None:
        batch = super().take_batch()
        if batch is None and self._taken == self.version and self._open == 0 and self._started_now >= self.max_started:
            # the draw budget is spent and nothing is in flight: train the useful groups there are
            batch = Batch(self.version, tuple(self._forming), tuple(self._dropped_since), ())
            self._forming, self._dropped_since = [], []
            self._taken += 1
            self.counts["batches"] += 1
            self.counts["short_batches"] += 1
        if batch is not None:
            self._started_now = 0
        return batch


@CONSUME_POLICIES.register("dynamic")
def _dynamic(sched: "SchedulingConfig", batch_size: int, *, version: int, filters: Sequence[SampleFilter]) -> DynamicSampling:
    return DynamicSampling(batch_size, max_draws=sched.dynamic_max_draws, skip_after=sched.dynamic_skip_after,
                           filters=filters, version=version)
