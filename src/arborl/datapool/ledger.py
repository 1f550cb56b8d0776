"""Exactly-once counts of a run's task stream, from the data pool's ledger (``DataPool.ledger``).

A run killed and resumed trains in *lineages*: attempt a's training at step k survives unless a later
attempt resumed from a checkpoint before k (its weights were lost with the kill). Over the surviving
trainings, a correct run has

* ``prompts_skipped`` 0: every stream position up to the last one the final attempt started was
  started, and its group was trained, resolved by the consumption policy's own rule (dropped,
  cancelled, failed: ``policy_resolved_groups``), taken into a batch without a learning signal
  (``groups_without_samples``: every reward equal), or was still in flight when the run ended;
* ``prompts_duplicated`` 0: no group trained at two surviving steps;
* ``episodes_trained_twice`` 0: no episode in two surviving trainings;
* ``episodes_dropped`` 0: every episode committed (finished and scored) in a trained or passed-over
  group was trained once.

``decoded_tokens_discarded``: the generated tokens of the episodes in flight at each kill (the resume
marked them aborted and ran them again) less ``replayed_tokens``, those their re-runs were served from the
record instead of decoding them again (``Gateway.create_session(replay=...)``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from arborl.datapool.store import DataPool
from arborl.types import EpisodeStatus

OPEN_STATES = ("running", "finished")


def surviving(trainings: list[dict[str, Any]], attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainings whose weights the run's final policy descends from."""
    starts = {a["attempt"]: a["from_step"] for a in attempts}
    return [t for t in trainings
            if all(starts[a] >= t["step"] for a in starts if a > t["attempt"])]


def exactly_once(pool: DataPool) -> dict[str, Any]:
    led = pool.ledger()
    attempts, groups = led["attempts"], led["stream_groups"]
    kept = surviving(led["trainings"], attempts)
    per_episode = Counter(t["episode_id"] for t in kept)
    steps_of: dict[str, set[int]] = {}
    for t in kept:
        steps_of.setdefault(t["group_id"], set()).add(t["step"])
    last = max((a["attempt"] for a in attempts), default=0)
    end = max((g["position"] for g in groups if g["attempt"] == last), default=-1)
    positions = {g["position"] for g in groups}
    skipped_groups = [g["group_id"] for g in groups if g["position"] <= end and g["group_id"] not in steps_of
                      and (g["state"] in OPEN_STATES or g["state"] == "trained")]
    policy_resolved = sum(g["state"] in ("dropped", "cancelled", "failed") and g["reason"] not in ("run ended", "no samples")
                          for g in groups)
    replayed = sum(len(c.completion_token_ids) for g in groups for e in pool.episodes(group_id=g["group_id"])
                   for c in e.calls if c.meta.get("replayed_from"))
    committed = [e for g in [*steps_of, *skipped_groups]
                 for e in pool.episodes(group_id=g, status=EpisodeStatus.FINISHED, with_calls=False)
                 if e.reward is not None]
    return {
        "kills": max(0, len(attempts) - 1),
        "prompts_started": len(positions),
        "prompts_trained": len(steps_of),
        "prompts_skipped": sum(1 for p in range(end + 1) if p not in positions) + len(skipped_groups),
        "prompts_duplicated": sum(len(s) > 1 for s in steps_of.values()),
        "policy_resolved_groups": policy_resolved,
        "groups_without_samples": sum(g["reason"] == "no samples" for g in groups),
        "episodes_trained": len(per_episode),
        "episodes_trained_twice": sum(n > 1 for n in per_episode.values()),
        "episodes_dropped": sum(per_episode[e.episode_id] == 0 for e in committed),
        "decoded_tokens_discarded": max(0, sum(a["discarded_tokens"] for a in attempts) - replayed),
        "replayed_tokens": replayed,
    }
