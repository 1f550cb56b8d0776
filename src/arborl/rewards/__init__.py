"""Rewards (outcome components, per-turn placement) and advantage estimators (GRPO, Dr.GRPO, reward-to-go)."""

from arborl.rewards.advantages import (
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
from arborl.rewards.outcome import combine_components, turn_rewards

__all__ = [
    "broadcast_to_tokens",
    "combine_components",
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
