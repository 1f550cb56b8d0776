"""Rewards (outcome components, per-turn placement, shaping) and advantage estimators (GRPO, Dr.GRPO, RLOO,
REINFORCE++, reward-to-go, auto)."""

from arborl.rewards.advantages import (
    broadcast_to_tokens,
    group_index,
    grpo_advantages,
    has_process_rewards,
    pad_turns,
    process_advantages,
    process_rewards,
    reward_to_go,
    reward_to_go_advantages,
    rloo_advantages,
    subtract_baseline,
    whiten,
    zero_variance_groups,
    zero_variance_mask,
)
from arborl.rewards.estimators import (
    ADVANTAGE_ESTIMATORS,
    Estimator,
    GroupNorm,
    estimate,
    resolve_estimator,
    with_process,
)
from arborl.rewards.chunk_returns import chunk_return_advantages, chunk_returns  # registers chunk_returns
from arborl.rewards.outcome import turn_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "chunk_return_advantages",
    "chunk_returns",
    "Estimator",
    "GroupNorm",
    "estimate",
    "resolve_estimator",
    "broadcast_to_tokens",
    "group_index",
    "grpo_advantages",
    "has_process_rewards",
    "pad_turns",
    "process_advantages",
    "process_rewards",
    "reward_to_go",
    "reward_to_go_advantages",
    "rloo_advantages",
    "subtract_baseline",
    "whiten",
    "with_process",
    "turn_rewards",
    "zero_variance_groups",
    "zero_variance_mask",
]
