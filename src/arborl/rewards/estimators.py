r"""Advantage estimators by name (``train.advantage.estimator``), each with its own settings like a loss
kind (``train.advantage.settings``, the fields of its ``Settings`` model, config/kinds.py).

An estimator takes the outcome rewards R [N] (float64), the per-turn rewards of each episode (process
rewards, outcome on the last turn) and the group ids, its own settings as keywords, and -- where its
signature names it -- ``norm``, the group normalisation every estimator shares (``train.advantage.std_normalize``,
``std``, ``eps``). It returns one advantage per episode [N] or one per turn [N, K] (0 past an episode's
last turn); turn k is chunk k of the episode's samples (C4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from pydantic import Field
from torch import Tensor

from arborl.config import AdvantageConfig
from arborl.config.kinds import KindSettings, named_context, resolve_kind, with_settings
from arborl.registry import Registry
from arborl.rewards.advantages import (
    GroupIds,
    TurnRewards,
    as_turns,
    grpo_advantages,
    has_process_rewards,
    process_advantages,
    process_rewards,
    reward_to_go,
    reward_to_go_advantages,
    rloo_advantages,
    subtract_baseline,
    whiten,
)


@dataclass(frozen=True)
class GroupNorm:
    """The group normalisation estimators share: divide by the group's std (``std_normalize``; sample std
    when ``unbiased``) plus ``eps``."""

    std_normalize: bool = True
    unbiased: bool = True
    eps: float = 1e-6

    @classmethod
    def of(cls, cfg: AdvantageConfig) -> "GroupNorm":
        return cls(std_normalize=cfg.std_normalize, unbiased=cfg.std == "unbiased", eps=cfg.eps)


class Estimator(Protocol):
    """An advantage estimator (module docstring): (R [N], per-turn rewards, group ids, its settings and,
    if named, ``norm``) -> [N] or [N, K]. Optional ``Settings``: the pydantic model of its settings."""

    def __call__(self, rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds,
                 **options: Any) -> Tensor: ...


ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")

# what an estimator may receive by naming it in its signature (besides its settings)
CONTEXT = ("norm",)


def with_process(outcome_adv: Tensor, rewards: Tensor, turns: TurnRewards, group_ids: GroupIds | None,
                 norm: GroupNorm) -> Tensor:
    r"""A per-episode advantage A_n plus the normalised process reward of each turn (C1):

        A_{n,k} = A_n + P_{n,k}        (:func:`process_advantages`; [N, K])

    so the outcome's credit reaches every turn of the episode and a turn's own process reward moves only
    that turn's tokens. Without any non-zero process reward in the batch this is A_n itself ([N])."""
    p, m = process_rewards(rewards, turns)
    if not bool((p != 0).any()):
        return outcome_adv
    term = process_advantages(p, m, group_ids, std_normalize=norm.std_normalize, eps=norm.eps, unbiased=norm.unbiased)
    return torch.where(m, outcome_adv.to(torch.float64)[:, None] + term, 0.0)


class ReturnSettings(KindSettings):
    """The discount of the turn returns."""

    gamma: float = Field(1.0, ge=0, le=1, description="discount per turn of the returns (1 = undiscounted)")


class AutoSettings(KindSettings):
    """auto: reward_to_go with its own discount when the batch has process rewards, else grpo."""

    gamma: float = Field(
        0.9, ge=0, le=1, description="discount per turn of reward_to_go when the batch has process rewards (C3)"
    )


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_estimator(rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds, *, norm: GroupNorm) -> Tensor:
    """GRPO (Dr.GRPO without std normalisation) on the outcome reward, plus the group-normalised process
    reward of each turn when there are process rewards (:func:`with_process`)."""
    adv = grpo_advantages(rewards, group_ids, std_normalize=norm.std_normalize, eps=norm.eps, unbiased=norm.unbiased)
    return with_process(adv, rewards, turns, group_ids, norm)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_estimator(rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds, *, norm: GroupNorm) -> Tensor:
    """RLOO on the outcome reward (leave-one-out group baseline), plus the group-normalised process
    reward of each turn when there are process rewards."""
    return with_process(rloo_advantages(rewards, group_ids), rewards, turns, group_ids, norm)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
@with_settings(ReturnSettings)
def reinforce_pp_estimator(rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds, *,
                           gamma: float, norm: GroupNorm) -> Tensor:
    r"""REINFORCE++ (Hu 2025; verl ``reinforce_plus_plus`` without the KL-in-reward): discounted returns
    of every turn, normalised over the whole batch, no baseline:

        A_{n,k} = whiten(G)_{n,k},   G_{n,k} = sum_{j>=k} gamma^{j-k} r_{n,j}

    (process rewards included). Each turn counts once in the batch statistics (verl counts each token)."""
    r, m = as_turns(turns, None)
    return whiten(reward_to_go(r, gamma=gamma, turn_mask=m), m, eps=norm.eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
@with_settings(ReturnSettings)
def reinforce_pp_baseline_estimator(rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds, *,
                                    gamma: float, norm: GroupNorm) -> Tensor:
    r"""REINFORCE++-baseline (verl ``reinforce_plus_plus_baseline``): the turn returns minus their group
    mean (the GRPO baseline without its std), then normalised over the whole batch:

        A = whiten(G - mean_{g(n)} G)

    With outcome rewards only and gamma = 1 this is verl's (R - group mean) whitened over the batch."""
    r, m = as_turns(turns, None)
    centred = subtract_baseline(reward_to_go(r, gamma=gamma, turn_mask=m), group_ids, turn_mask=m)
    return whiten(centred, m, eps=norm.eps)


@ADVANTAGE_ESTIMATORS.register("reward_to_go")
@with_settings(ReturnSettings)
def reward_to_go_estimator(rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds, *,
                           gamma: float, norm: GroupNorm) -> Tensor:
    """Reward-to-go from each turn minus the group mean (C3), one value per turn (C4)."""
    return reward_to_go_advantages(turns, group_ids, gamma=gamma, std_normalize=norm.std_normalize, eps=norm.eps,
                                   unbiased=norm.unbiased)


@ADVANTAGE_ESTIMATORS.register("auto")
@with_settings(AutoSettings)
def auto_estimator(rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds, *,
                   gamma: float, norm: GroupNorm) -> Tensor:
    """reward_to_go discounted by ``gamma`` when any episode of the batch has a process reward (C3: the
    multi-turn default), else GRPO on the outcome."""
    if has_process_rewards(rewards, turns):
        return reward_to_go_estimator(rewards, turns, group_ids, gamma=gamma, norm=norm)
    return grpo_estimator(rewards, turns, group_ids, norm=norm)


def resolve_estimator(cfg: AdvantageConfig) -> tuple[Estimator, dict[str, Any]]:
    """The estimator ``cfg.estimator`` names and its settings ``cfg.settings``, validated by its
    ``Settings`` model (defaults filled in). Raises :class:`ConfigError` naming ``train.advantage.estimator``
    or ``train.advantage.settings.<field>``."""
    return resolve_kind(ADVANTAGE_ESTIMATORS, cfg.estimator, cfg.settings, kind_key="train.advantage.estimator",
                        settings_key="train.advantage.settings", context=CONTEXT)


def estimate(cfg: AdvantageConfig, rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds,
             estimator: Callable[..., Tensor] | None = None) -> Tensor:
    """The advantages of ``cfg.estimator`` (or ``estimator``, with the settings its model defaults to),
    called with its settings and the shared ``norm`` where it names it."""
    settings: dict[str, Any] = {}
    if estimator is None:
        estimator, settings = resolve_estimator(cfg)
    return estimator(rewards, turns, group_ids, **settings, **named_context(estimator, {"norm": GroupNorm.of(cfg)}))
