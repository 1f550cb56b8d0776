"""Rollout scheduling (scheduling/): consumption, dispatch, partial rollout, curriculum."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from arborl.config.base import Section, comma_list


AFFINITY = "affinity"  # scheduling.dispatch: the engine pool's session placement, not a dispatch policy


class SchedulingConfig(Section):
    """Rollout scheduling for the long tail: consumption policy (S1, S2, S4), dispatch (S5, S6), partial rollout."""

    consume: str = Field(
        "sync",
        description="what the trainer may consume (registry rollout.consume.CONSUME_POLICIES): sync = on-policy, the "
        "step waits for its batch; async_ratio = ROLL's bounded staleness; windowed_fifo = Forge's generation-order "
        "window; dynamic = sync that skips all-equal groups and over-draws to keep the batch full (DAPO, "
        "scheduling/dynamic.py); or a path to your own, package.module:attr or path/to/file.py:attr",
    )
    dynamic_max_draws: float = Field(
        3.0, ge=1, description="dynamic: most groups started per step, as a multiple of the batch (batches)")
    dynamic_skip_after: int = Field(
        2, ge=0, description="dynamic: skip a task whose last this-many groups were all-pass or all-fail "
        "(groups; 0 = never skip tasks)")
    curriculum_key: str = Field(
        "", description="curriculum: the task metadata key whose values order the tasks by difficulty (code_repair: "
        "tier; a dataset: any column); '' = off. Training draws only tasks whose value is unlocked; evaluation is "
        "never filtered")
    curriculum: list[str] = Field(
        default_factory=list, description="curriculum: the key's values from easiest to hardest (e.g. [easy, medium, "
        "hard]); the first is unlocked at the start, one more every curriculum_steps steps; a task whose value is "
        "missing or not listed comes after all of them")
    curriculum_steps: int = Field(
        10, ge=1, description="curriculum: training steps before the next value is unlocked (steps)")
    async_ratio: float = Field(
        1.0,
        ge=0,
        description="α: generation runs at most α batches ahead of training and async_ratio trains no sample older "
        "than ceil(α) versions (α = 1: one version); also the look-ahead of windowed_fifo (batches)",
    )
    window: float = Field(
        0.3,
        gt=0,
        description="W of windowed_fifo as a fraction of the batch (Forge: 0.3): only finished items fewer than W "
        "items after the oldest unfinished one may be consumed (fraction of batch items)",
    )
    max_version_gap: int | None = Field(
        None,
        ge=0,
        description="slime S4, composes with any policy: drop a finished item whose oldest token is more than this "
        "many versions behind the trainer (versions; None = off)",
    )
    oversample: float = Field(
        0.0,
        ge=0,
        description="sync: start (1 + oversample) x batch items per step, train the first batch to finish and cancel "
        "the surplus (fraction of the batch)",
    )
    dispatch: str = Field(
        "affinity",
        description="where requests run (registry scheduling.dispatch.DISPATCH_POLICIES): affinity = the engine pool's "
        "own placement (engine/affinity.py): each request whole on one engine, a session's calls on the engine that "
        "holds its prefix until that engine has gateway.affinity_max_load requests in flight, then on the least "
        "loaded; pinned = each group pinned for good to the least-loaded engine instance at its first request, its "
        "requests whole, first come first served (veRL-like); seer = one global queue, divided rollout, probes "
        "first, then longest estimated group first; or a path to your own, package.module:attr or "
        "path/to/file.py:attr. Every value but affinity is a dispatch policy: the engine pool serves it through "
        "the dispatcher (engine/dispatcher.py), grouped by the session's group_id, and the simulator models it "
        "(sim.policies). partial_rollout=abort_resume needs a dispatch policy: unset, dispatch is pinned there",
    )
    chunk_tokens: int = Field(
        4096,
        ge=0,
        description="seer divided rollout: most new tokens a request generates before it returns to the global "
        "queue (tokens; 0 = whole requests)",
    )
    context_aware: bool = Field(
        True, description="seer: one probe per group first, then longest group-length estimate first (false: FIFO queue)"
    )
    starvation_s: float = Field(
        600.0,
        ge=0,
        description="seer anti-starvation: a request queued this long runs before all others, oldest first "
        "(seconds; 0 = off)",
    )
    partial_rollout: Literal["continue", "abort_resume"] = Field(
        "continue",
        description="requests in flight at a weight update: continue (later tokens carry the new version) or are "
        "aborted before the new weights load and resumed from their tokens through the dispatch queue",
    )
    stale_token_mask: int | None = Field(
        None,
        ge=0,
        description="partial rollout: loss-mask tokens produced by a policy more than this many versions behind the "
        "trainer (versions; None = train on all)",
    )
    migration: Literal["recompute", "transfer"] = Field(
        "transfer",
        description="a request continuing on another engine instance: recompute its KV (prefill) or transfer the "
        "KV from the instance that holds it (transfer measured 4-12x faster on the built-in engine)",
    )
    timeline: bool = Field(
        True, description="record per-request rollout events and write a Gantt PNG per step into the run directory"
    )

    @field_validator("curriculum", mode="before")
    @classmethod
    def _curriculum_list(cls, value: Any) -> Any:
        return comma_list(value)  # --set scheduling.curriculum=easy,medium,hard

    @model_validator(mode="before")
    @classmethod
    def _abort_resume_dispatch(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("partial_rollout") == "abort_resume" and "dispatch" not in data:
            return {**data, "dispatch": "pinned"}  # aborting and re-queueing needs a dispatch policy
        return data

    @model_validator(mode="after")
    def _dispatch_for_abort_resume(self) -> "SchedulingConfig":
        if self.partial_rollout == "abort_resume" and self.dispatch == AFFINITY:
            raise ValueError("scheduling.partial_rollout=abort_resume aborts requests at a weight update and re-queues "
                             "them through a dispatch policy, which scheduling.dispatch=affinity (the engine pool's "
                             "session placement) is not: set scheduling.dispatch=pinned (each group whole on one "
                             "engine) or seer")
        return self

    @model_validator(mode="after")
    def _curriculum_complete(self) -> "SchedulingConfig":
        if bool(self.curriculum_key) != bool(self.curriculum):
            raise ValueError("scheduling.curriculum_key and scheduling.curriculum go together: set both (e.g. "
                             "curriculum_key=tier, curriculum=[easy,medium,hard]) or neither")
        return self
