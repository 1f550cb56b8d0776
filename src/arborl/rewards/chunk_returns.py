r"""Chunk returns (C4, ROLL's IPA): the outcome reward propagated along interaction chunks, not tokens.

A chunk is one model turn, the span between two environment interactions (``Sample.chunk_ids``);
episode n has K_n chunks and outcome reward R_n. Its chunk k (0-based) gets the return discounted by
its distance to the episode's end,

    G_{n,k} = gamma^(K_n - 1 - k) * R_n

so the last chunk (the one that produced the outcome) gets R_n and earlier ones less, and the
advantage subtracts the group's mean over all chunks of all its episodes (and with
``std_normalize`` divides by their std), as ROLL's chunk-level ``step_reinforce`` estimator
normalises each chunk's return inside its group:

    A_{n,k} = (G_{n,k} - mean_{m in g(n), j < K_m} G_{m,j}) [/ (std_{...} G + eps)]

Process rewards are not part of it (use reward_to_go for those). gamma = 1 gives every chunk of an
episode the same return: group-mean outcome advantages, each chunk weighted by its count.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
from torch import Tensor

from arborl.config.kinds import with_settings
from arborl.rewards.advantages import GroupIds, subtract_baseline
from arborl.rewards.estimators import ADVANTAGE_ESTIMATORS, GroupNorm, ReturnSettings


def chunk_returns(
    rewards: Sequence[float] | Tensor, num_chunks: Sequence[int], *, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """G [N, K] with G[n, k] = gamma^(K_n - 1 - k) R_n for k < K_n (0 beyond), and the chunk mask [N, K]
    (K = the longest episode's chunk count), in float64."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    k_n = torch.as_tensor(list(num_chunks), dtype=torch.long)
    if k_n.numel() != r.numel():
        raise ValueError(f"{r.numel()} rewards but {k_n.numel()} chunk counts")
    if bool((k_n < 0).any()):
        raise ValueError("chunk counts must be >= 0")
    k = int(k_n.max()) if k_n.numel() else 0
    pos = torch.arange(k)[None, :]
    mask = pos < k_n[:, None]
    distance = (k_n[:, None] - 1 - pos).clamp(min=0).to(torch.float64)
    g = torch.where(mask, r[:, None] * torch.as_tensor(gamma, dtype=torch.float64) ** distance, 0.0)
    return g, mask


def chunk_return_advantages(
    rewards: Sequence[float] | Tensor,
    num_chunks: Sequence[int],
    group_ids: GroupIds,
    *,
    gamma: float = 1.0,
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Per-chunk advantages A [N, K] (0 past an episode's last chunk): see the module docstring."""
    g, mask = chunk_returns(rewards, num_chunks, gamma=gamma)
    return subtract_baseline(g, group_ids, turn_mask=mask, std_normalize=std_normalize, eps=eps)


@ADVANTAGE_ESTIMATORS.register("chunk_returns")
@with_settings(ReturnSettings)
def chunk_returns_estimator(rewards: Tensor, turns: Sequence[Sequence[float]], group_ids: GroupIds, *,
                            gamma: float, norm: GroupNorm) -> Tensor:
    """IPA's chunk returns (C4): gamma^(distance to the end) x outcome reward per chunk, group-baselined;
    one value per chunk (turn k = chunk k). Uses its ``gamma`` and the shared ``std_normalize`` and ``eps``."""
    return chunk_return_advantages(rewards, [len(t) for t in turns], group_ids, gamma=gamma,
                                   std_normalize=norm.std_normalize, eps=norm.eps)
