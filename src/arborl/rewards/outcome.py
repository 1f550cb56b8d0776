r"""Outcome rewards and their placement on turns.

A task scores an episode with named components (``Episode.reward_components``); its ``outcome``
component is the scalar reward R. :func:`turn_rewards` lays R and any per-turn (process) rewards out
on the episode's K turns, which is what :func:`arborl.rewards.advantages.reward_to_go` consumes:

    r_k = p_k + [k = K-1] R            (outcome credited to the last turn)
"""

from __future__ import annotations

from collections.abc import Sequence


def turn_rewards(outcome: float, num_turns: int, process: Sequence[float] | None = None) -> list[float]:
    """Per-turn rewards of an episode of ``num_turns`` turns: process reward p_k on turn k (0 when
    not given) plus the outcome on the last turn. An episode with no turn has no reward to place: []."""
    if num_turns < 0:
        raise ValueError(f"num_turns must be >= 0, got {num_turns}")
    if process is not None and len(process) != num_turns:
        raise ValueError(f"{len(process)} process rewards for {num_turns} turns")
    r = [float(p) for p in process] if process is not None else [0.0] * num_turns
    if num_turns:
        r[-1] += float(outcome)
    return r
