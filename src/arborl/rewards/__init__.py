"""Rewards (outcome components, per-turn placement) and advantage estimators (GRPO, Dr.GRPO, reward-to-go)."""

from arborl.rewards.advantages import (
    ADVANTAGE_ESTIMATORS,
    Estimator,
    broadcast_to_tokens,
    group_index,
    grpo_advantages,
    pad_turns,
    reward_to_go,
    reward_to_go_advantages,
    subtract_baseline,
    zero_variance_groups,
    zero_variance_mask,
)
from arborl.rewards.outcome import turn_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "Estimator",
    "broadcast_to_tokens",
    "group_index",
    "grpo_advantages",
    "pad_turns",
    "reward_to_go",
    "reward_to_go_advantages",
    "subtract_baseline",
    "turn_rewards",
    "zero_variance_groups",
    "zero_variance_mask",
]
