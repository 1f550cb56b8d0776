r"""Reward composition before the advantage (Forge's composite reward, seed C1 + C2).

An episode's reward has three parts: the task's outcome R (success), per-turn process rewards p_k
(malformed tool calls, tool errors, language mixing, correct steps: C1) and a completion-time reward s
(finishing faster than the rest of the group: C2). ``train.advantage.shaping`` weighs them:

    r_k = w_p p_k + [k = K-1] (w_t s + w_o R)

i.e. process rewards stay on their own turn and the shaped outcome R' = w_t s + w_o R lands on the
last turn, which is the layout every estimator reads (:func:`arborl.rewards.outcome.turn_rewards`).

Speed reward, relative to the group. With c_i the completion cost of episode i (wall seconds, model
calls or generated tokens) and E the eligible episodes of i's group (the successful ones when
``speed_success_only``, else all):

    s_i = clip((mean_{j in E} c_j - c_i) / mean_{j in E} c_j, -1, 1)     for i in E, else 0

so s is scale-free, 0 on average over E, positive for faster-than-average episodes, and 0 when E
holds fewer than two episodes (nothing to compare with). Only successful episodes being eligible by
default means a policy is never paid for failing fast.
"""

from __future__ import annotations

from collections.abc import Sequence

from arborl.rewards.advantages import GroupIds, group_index
from arborl.rewards.outcome import turn_rewards


def task_reward(components: dict[str, float], weights: dict[str, float]) -> float:
    """The episode's reward R from the components its task reported: ``outcome`` plus each weighted
    component (``shaping.component_weights``, e.g. ``tests_passed_frac``: partial credit); a component the
    task did not report counts 0."""
    return float(components.get("outcome", 0.0)) + sum(w * float(components.get(k, 0.0)) for k, w in weights.items())


def speed_rewards(costs: Sequence[float], group_ids: GroupIds, eligible: Sequence[bool] | None = None) -> list[float]:
    """Completion-time reward s_i of each episode (module docstring); ``eligible`` None = every episode."""
    n = len(costs)
    index, keys = group_index(group_ids, n)
    ok = [True] * n if eligible is None else [bool(e) for e in eligible]
    if len(ok) != n:
        raise ValueError(f"{len(ok)} eligibility flags for {n} episodes")
    total, count = [0.0] * len(keys), [0] * len(keys)
    for i, g in enumerate(index.tolist()):
        if ok[i]:
            total[g] += float(costs[i])
            count[g] += 1
    out = []
    for i, g in enumerate(index.tolist()):
        mean = total[g] / count[g] if count[g] else 0.0
        if not ok[i] or count[g] < 2 or mean <= 0:
            out.append(0.0)
        else:
            out.append(max(-1.0, min(1.0, (mean - float(costs[i])) / mean)))
    return out


def compose(
    outcome: float, process: Sequence[float], speed: float, *, process_weight: float, speed_weight: float,
    outcome_weight: float,
) -> tuple[float, list[float]]:
    """(shaped outcome R' = w_t s + w_o R, per-turn rewards r_k = w_p p_k + [k = K-1] R') of one episode."""
    shaped = speed_weight * speed + outcome_weight * outcome
    return shaped, turn_rewards(shaped, len(process), [process_weight * p for p in process])
