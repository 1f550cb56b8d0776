"""The two scheduling decisions of a rollout cluster, as protocols over an abstract event interface.

* A **consumption policy** (``scheduling/consume.py``: sync, async_ratio, windowed_fifo) decides which
  finished items the trainer may take, when a new item may start, and which running items can no
  longer be trained and should be cancelled. An *item* is the unit the trainer consumes: a GRPO group
  in the controllers of arborl (its advantages need every member), an episode elsewhere.
* A **dispatch policy** (``scheduling/dispatch.py``: pinned, seer) decides which request runs next on an
  engine instance that has room, and how many new tokens it may produce before it comes back.

Both are pure decision logic: they see only events (start / finish / chunk done / version bump /
cancel) and the clock value passed in, never an engine, a thread or a wall clock. The simulator
(``arborl.sim``) and the real controllers call the *same* classes; ``Traced`` records every call and
its answer so that a recorded run can be replayed into fresh policies and compared decision by
decision (``replay``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


# ----------------------------------------------------------------------------------- consumption


@dataclass(frozen=True, slots=True)
class Batch:
    """What the trainer takes: items to train on at ``version``, plus bookkeeping of this take."""

    version: int  # trainer version that trains this batch (the batch's tokens are compared to it)
    items: tuple[str, ...]  # consumed, in consumption order
    dropped: tuple[str, ...] = ()  # finished items dropped while forming it (too stale, surplus, filter)
    cancel: tuple[str, ...] = ()  # running items the caller must abort (surplus of an over-sampled batch)


@runtime_checkable
class ConsumePolicy(Protocol):
    """Decides what the trainer consumes. Calls: ``on_start`` when an item starts (``can_start`` said
    yes), ``on_finish`` / ``on_fail`` when it ends, ``take_batch`` whenever the trainer is idle and
    ready for its next batch (the answer is trained at ``version``), ``on_version`` when the trainer
    published new weights (returns running items that can never be trained: abort them),
    ``on_batch_skipped`` when the batch taken was not trained (the version stays). ``snapshot`` (a
    JSON-able dict, between steps) goes into a checkpoint; a fresh policy at the checkpoint's version
    ``restore``s it and returns the open items, which the controller starts again. ``overlaps_training``:
    whether items may be generated while the trainer trains (async) or each step waits for its batch
    (sync-like); the step's rollout tokens/s is per second of the step or of its rollout accordingly."""

    name: str
    batch_size: int
    version: int
    overlaps_training: bool

    def can_start(self) -> bool: ...

    def on_start(self, item_id: str) -> int: ...

    def on_finish(self, item_id: str, min_version: int | None = None) -> None: ...

    def on_fail(self, item_id: str) -> None: ...

    def take_batch(self) -> Batch | None: ...

    def on_version(self, version: int) -> list[str]: ...

    def on_batch_skipped(self) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def snapshot(self) -> dict: ...

    def restore(self, snap: dict) -> list[str]: ...


# -------------------------------------------------------------------------------------- dispatch


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request (one model call) as the dispatcher knows it."""

    request_id: str
    group_id: str
    max_tokens: int  # cap on the request's total new tokens (across all its chunks)
    generated: int = 0  # tokens it already has (a resumed or continued request)


@dataclass(frozen=True, slots=True)
class Assignment:
    """Run ``request_id`` on ``instance`` for at most ``max_new_tokens`` new tokens, then report back."""

    request_id: str
    group_id: str
    instance: int
    max_new_tokens: int
    priority: int = 0  # engine priority (higher first): probes 2, starved 1, others 0
    probe: bool = False  # the group's probe (its first request, while no member has finished)
    starved: bool = False  # picked by the anti-starvation rule


PRIORITY_PROBE = 2
PRIORITY_STARVED = 1


@runtime_checkable
class DispatchPolicy(Protocol):
    """Decides which request runs where. Calls: ``submit`` when a request exists, ``next_for`` when
    instance ``i`` has room (None: nothing for it), ``on_chunk_done`` when an assignment came back
    (``generated`` = the request's total new tokens so far; ``finished`` = it will not continue),
    ``requeue`` when a running request was taken off its instance unfinished (preempted, or aborted
    for resumption after a weight update), ``cancel_group`` / ``cancel`` when a group / a request is
    no longer wanted (both return what is running: abort it)."""

    name: str

    def submit(self, spec: RequestSpec, now: float) -> None: ...

    def next_for(self, instance: int, now: float) -> Assignment | None: ...

    def on_chunk_done(self, request_id: str, generated: int, finished: bool, now: float) -> None: ...

    def requeue(self, request_id: str, generated: int, now: float) -> None: ...

    def cancel_group(self, group_id: str) -> list[str]: ...

    def cancel(self, request_id: str) -> bool: ...

    def pending(self) -> int: ...


# ------------------------------------------------------------------------------- record / replay


@dataclass
class Traced:
    """A policy wrapper recording ``(method, args, answer)`` of every decision-relevant call.

    The simulator and the real controllers wrap their policies in it when asked; ``replay`` feeds the
    recorded calls, in order, to a fresh policy and checks that every answer is the same."""

    policy: Any
    calls: list[tuple[str, tuple, Any]] = field(default_factory=list)

    METHODS = frozenset(
        {"can_start", "on_start", "on_finish", "on_fail", "take_batch", "on_version",
         "submit", "next_for", "on_chunk_done", "requeue", "cancel_group", "cancel", "forget"}
    )

    def __getattr__(self, name: str):
        attr = getattr(self.policy, name)
        if name not in self.METHODS:
            return attr

        def call(*args):
            out = attr(*args)
            self.calls.append((name, args, _freeze(out)))
            return out

        return call


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    return value


class ReplayMismatch(AssertionError):
    pass


def replay(calls: Sequence[tuple[str, tuple, Any]], policy: Any) -> int:
    """Re-issue recorded calls to ``policy``; raise ReplayMismatch at the first different answer.
    Returns the number of calls replayed."""
    for i, (name, args, expect) in enumerate(calls):
        got = _freeze(getattr(policy, name)(*args))
        if got != expect:
            raise ReplayMismatch(f"call {i} {name}{args}: recorded {expect!r}, replayed {got!r}")
    return len(calls)


# ----------------------------------------------------------------------------------- small utils


def window_items(window: float, batch_size: int) -> int:
    """W of windowed FIFO in items: a fraction of the batch (Forge: 0.3 N), at least 1."""
    return max(1, math.ceil(window * batch_size - 1e-9))


def ahead_items(alpha: float, batch_size: int) -> int:
    """Items that may be started and not yet trained, counting the batch in training: (1 + α) N."""
    return max(1, math.floor((1.0 + alpha) * batch_size + 1e-9))

