r"""Advantage estimators: GRPO / Dr.GRPO, RLOO, REINFORCE++ (and its baseline variant) on outcome
rewards, process rewards on their turns under every one of them (C1), reward-to-go on per-turn rewards
(C3, and ``auto``), and the broadcast of per-sample or per-turn values onto tokens (chunked MDP, C4).

Shapes: N samples (episodes), K turns (= chunks), T tokens. ``group_ids`` is one hashable per
sample (``Sample.group_id`` strings, ints, or a 1-D tensor); samples of one group answered the same task.

Pipeline of a step (the controller and trainer glue these together)::

    outcome rewards R [N] -> zero_variance_mask -> drop those groups, count them
                          -> grpo_advantages                           -> A [N]
    per-turn rewards r [N][K_n] -> reward_to_go -> subtract_baseline   -> A [N, K]
    A -> broadcast_to_tokens(A, loss_mask, chunk_ids)                  -> A [N, T] for the loss

Turn / chunk contract (C4): a chunk is the span of tokens between two environment interactions,
i.e. one model turn; ``chunk_ids[n, t] == k`` means token t of sample n belongs to turn k, and turn k
is entry k of that sample's per-turn rewards. Prompt / observation tokens carry any chunk id: they
are outside the loss mask and receive 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
import torch
from torch import Tensor

GroupIds = Sequence[Hashable] | Tensor
TurnRewards = Sequence[Sequence[float]] | Tensor


# ----------------------------------------------------------------------------- group helpers


def group_index(group_ids: GroupIds, n: int | None = None) -> tuple[Tensor, list[Hashable]]:
    """Map group ids to dense indices: ``(index [N] long, keys in first-appearance order)``."""
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if n is not None and len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries but there are {n} samples")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.long), list(dense)


def _as_float(x: Sequence[float] | Tensor) -> Tensor:
    """A floating tensor: a floating tensor as it is; anything else (lists, ints) in the default dtype."""
    t = torch.as_tensor(x)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def _as_f64(x: Sequence[float] | Tensor) -> tuple[Tensor, torch.dtype]:
    """(values in float64 for the statistics, the dtype to return them in)."""
    if isinstance(x, Tensor):
        return x.to(torch.float64), (x.dtype if x.is_floating_point() else torch.get_default_dtype())
    return torch.as_tensor(x, dtype=torch.float64), torch.get_default_dtype()


def _group_mean_std(
    values: Tensor, index: Tensor, groups: int, weight: Tensor | None = None, *, unbiased: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-group mean and std of ``values`` [M] with optional 0/1 ``weight``: the population std (divide
    by the count n) or, ``unbiased``, the sample std (divide by n - 1; a group of one has std 0)."""
    w = torch.ones_like(values) if weight is None else weight.to(values.dtype)
    count = values.new_zeros(groups).index_add_(0, index, w)
    mean = values.new_zeros(groups).index_add_(0, index, w * values) / count.clamp(min=1)
    dof = (count - 1 if unbiased else count).clamp(min=1)
    var = values.new_zeros(groups).index_add_(0, index, w * (values - mean[index]) ** 2) / dof
    return mean, var.sqrt()


# ----------------------------------------------------------------------------- GRPO


def grpo_advantages(
    rewards: Sequence[float] | Tensor,
    group_ids: GroupIds,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> Tensor:
    r"""Group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath), one per sample.

        A_i = (R_i - mean_{j in g(i)} R_j) / (std_{j in g(i)} R_j + eps)     std_normalize=True
        A_i =  R_i - mean_{j in g(i)} R_j                                    std_normalize=False

    std is the population std of the group (divide by G) or, ``unbiased``, the sample std (divide
    by G - 1: verl's and TRL's ``torch.std``, what ``train.advantage.std=unbiased`` -- the config
    default -- selects). A group of one has A = 0 either way. A zero-variance group gets A = 0 for all
    its samples; it carries no learning signal — drop it with :func:`zero_variance_mask` and count it.

    Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") = ``std_normalize=False``
    here PLUS the constant length normaliser, which is a loss-aggregation choice, not an advantage:
    ``aggregation="constant"`` in :func:`arborl.train.losses.aggregate` (sum over tokens / (B x L)).

    Args: rewards [N]; group_ids: N hashables. Returns A [N], computed in float64, returned in the
    dtype of a floating ``rewards`` tensor (else the default dtype).
    """
    r, dtype = _as_f64(rewards)
    r = r.reshape(-1)
    index, keys = group_index(group_ids, r.numel())
    mean, std = _group_mean_std(r, index, len(keys), unbiased=unbiased)
    adv = r - mean[index]
    if std_normalize:
        adv = adv / (std[index] + eps)
    return adv.to(dtype)


def rloo_advantages(rewards: Sequence[float] | Tensor, group_ids: GroupIds) -> Tensor:
    r"""REINFORCE leave-one-out (RLOO, Kool et al. 2019; Ahmadian et al. 2024), one per sample:

        A_i = R_i - 1/(G-1) sum_{j in g(i), j != i} R_j  =  G/(G-1) (R_i - mean_{g(i)} R)

    a baseline that does not contain the sample's own reward (unbiased). A group of one has A = 0.
    Computed in float64, returned as :func:`grpo_advantages` does."""
    r, dtype = _as_f64(rewards)
    r = r.reshape(-1)
    index, keys = group_index(group_ids, r.numel())
    count = r.new_zeros(len(keys)).index_add_(0, index, torch.ones_like(r))[index]
    total = r.new_zeros(len(keys)).index_add_(0, index, r)[index]
    adv = torch.where(count > 1, r - (total - r) / (count - 1).clamp(min=1), 0.0)
    return adv.to(dtype)


def whiten(values: Tensor, mask: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    r"""Batch normalisation of REINFORCE++ (Hu 2025): ``(x - mean) / (std + eps)`` over the valid entries
    (``mask``; all when None), std the sample std (n - 1) as verl's ``masked_whiten``; 0 off the mask."""
    x = _as_float(values)
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    flat = x.reshape(-1)
    mean, std = _group_mean_std(flat, torch.zeros_like(flat, dtype=torch.long), 1, m.reshape(-1), unbiased=True)
    return torch.where(m, (x - mean[0]) / (std[0] + eps), 0.0)


def zero_variance_mask(rewards: Sequence[float] | Tensor, group_ids: GroupIds, *, tol: float = 0.0) -> Tensor:
    """Bool [N]: True for samples whose group's rewards all lie within ``tol`` of each other
    (max - min <= tol, in float64; exact equality when tol = 0). The controller drops these and counts them."""
    r = _as_f64(rewards)[0].reshape(-1)
    index, keys = group_index(group_ids, r.numel())
    g = len(keys)
    hi = r.new_full((g,), -torch.inf).scatter_reduce(0, index, r, reduce="amax")
    lo = r.new_full((g,), torch.inf).scatter_reduce(0, index, r, reduce="amin")
    return ((hi - lo) <= tol)[index]


def zero_variance_groups(
    rewards: Sequence[float] | Tensor, group_ids: GroupIds, *, tol: float = 0.0
) -> list[Hashable]:
    """The group ids whose rewards all lie within ``tol`` of each other, in first-appearance order."""
    flags = zero_variance_mask(rewards, group_ids, tol=tol).tolist()
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    out: dict[Hashable, None] = {}
    for g, f in zip(ids, flags):
        if f:
            out.setdefault(g)
    return list(out)


# ----------------------------------------------------------------------------- reward-to-go (C3)


def pad_turns(step_rewards: Sequence[Sequence[float]], dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Ragged per-turn rewards -> ``(rewards [N, K] zero-padded, turn_mask [N, K] bool)``, K = longest."""
    n, k = len(step_rewards), max((len(s) for s in step_rewards), default=0)
    out = torch.zeros(n, k, dtype=dtype or torch.get_default_dtype())
    mask = torch.zeros(n, k, dtype=torch.bool)
    for i, s in enumerate(step_rewards):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(list(s), dtype=out.dtype)
            mask[i, : len(s)] = True
    return out, mask


def as_turns(step_rewards: TurnRewards, turn_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if isinstance(step_rewards, Tensor):
        r = _as_float(step_rewards)
        if r.dim() != 2:
            raise ValueError(f"per-turn rewards must be [N, K], got shape {tuple(r.shape)}")
        m = torch.ones_like(r, dtype=torch.bool) if turn_mask is None else turn_mask.to(torch.bool)
        return torch.where(m, r, 0.0), m
    r, m = pad_turns(step_rewards, dtype=torch.float64)  # Python floats: keep their precision
    return r, (m if turn_mask is None else m & turn_mask.to(torch.bool))


def reward_to_go(step_rewards: TurnRewards, *, gamma: float = 1.0, turn_mask: Tensor | None = None) -> Tensor:
    r"""Per-turn returns (seed C3, Forge's reward-to-go): the reward from the current turn to the end.

        G_{n,t} = sum_{k=t}^{K_n - 1} gamma^{k-t} r_{n,k}          (backwards: G_t = r_t + gamma G_{t+1})

    A turn is not credited with rewards that came before it, which removes that noise from its
    return (lower variance than the episode total). ``step_rewards``: a ragged list of lists, or a
    padded [N, K] tensor whose padding is excluded by ``turn_mask`` (or is zero). Returns G [N, K],
    0 on padding.
    """
    r, m = as_turns(step_rewards, turn_mask)
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return torch.where(m, out, 0.0)


def subtract_baseline(
    returns: Tensor,
    group_ids: GroupIds | None = None,
    *,
    turn_mask: Tensor | None = None,
    baseline: Tensor | float | None = None,
    std_normalize: bool = False,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> Tensor:
    r"""Advantages from per-turn returns G [N, K]: ``A_{n,t} = G_{n,t} - b``.

    ``baseline`` given (scalar, [N] per sample, or [N, K] per turn): b is it. Otherwise b is the
    group mean of the returns over every valid turn of every sample of the group (longer episodes
    weigh more), and with ``std_normalize`` A is divided by that pooled group std + eps (population,
    or the sample std with ``unbiased``).
    Returns A [N, K], 0 on padding turns.
    """
    g = _as_float(returns)
    m = torch.ones_like(g, dtype=torch.bool) if turn_mask is None else turn_mask.to(torch.bool)
    if baseline is not None:
        b = torch.as_tensor(baseline, dtype=g.dtype)
        adv = g - (b[:, None] if b.dim() == 1 else b)
        if std_normalize:
            raise ValueError("std_normalize uses group statistics; it cannot be combined with a given baseline")
    else:
        if group_ids is None:
            raise ValueError("subtract_baseline needs group_ids (group-mean baseline) or an explicit baseline")
        index, keys = group_index(group_ids, g.shape[0])
        rows = index[:, None].expand_as(g).reshape(-1)
        mean, std = _group_mean_std(g.reshape(-1), rows, len(keys), weight=m.reshape(-1), unbiased=unbiased)
        adv = g - mean[index][:, None]
        if std_normalize:
            adv = adv / (std[index][:, None] + eps)
    return torch.where(m, adv, 0.0)


def reward_to_go_advantages(
    step_rewards: TurnRewards,
    group_ids: GroupIds,
    *,
    gamma: float = 1.0,
    std_normalize: bool = False,
    eps: float = 1e-6,
    turn_mask: Tensor | None = None,
    unbiased: bool = False,
) -> Tensor:
    """reward_to_go then the group-mean baseline: per-turn advantages A [N, K] (0 on padding)."""
    r, m = as_turns(step_rewards, turn_mask)
    returns = reward_to_go(r, gamma=gamma, turn_mask=m)
    return subtract_baseline(returns, group_ids, turn_mask=m, std_normalize=std_normalize, eps=eps, unbiased=unbiased)


# ----------------------------------------------------------------------------- onto tokens (C4)


def broadcast_to_tokens(values: Tensor | Sequence[float], mask: Tensor, chunk_ids: Tensor | None = None) -> Tensor:
    r"""Token advantages [N, T] from per-sample [N] or per-chunk [N, K] values.

        A_{n,t} = values[n]                   (values [N]: every loss token of the sample)
        A_{n,t} = values[n, chunk_ids[n, t]]  (values [N, K]: the token's chunk = its turn, C4)

    and 0 where ``mask`` is 0. A loss token whose chunk id is outside [0, K) raises ValueError.
    """
    v = _as_float(values)
    m = mask > 0
    if v.dim() == 1:
        return torch.where(m, v[:, None].expand(m.shape), 0.0)
    if chunk_ids is None:
        raise ValueError("per-chunk values [N, K] need chunk_ids [N, T]")
    c = torch.as_tensor(chunk_ids, dtype=torch.long)
    if c.shape != m.shape or v.shape[0] != m.shape[0]:
        raise ValueError(f"shapes disagree: values {tuple(v.shape)}, mask {tuple(m.shape)}, chunk_ids {tuple(c.shape)}")
    bad = m & ((c < 0) | (c >= v.shape[1]))
    if bad.any():
        n, t = bad.nonzero()[0].tolist()
        raise ValueError(f"loss token {t} of sample {n} has chunk id {c[n, t].item()} outside [0, {v.shape[1]})")
    out = v.gather(1, c.clamp(0, max(v.shape[1] - 1, 0))) if v.shape[1] else v.new_zeros(m.shape)
    return torch.where(m, out, 0.0)


# ----------------------------------------------------------------------------- process rewards (C1)


def process_rewards(rewards: Sequence[float] | Tensor, turns: TurnRewards) -> tuple[Tensor, Tensor]:
    """The process part of per-turn rewards: ``(p [N, K] float64, turn_mask [N, K])`` where ``turns`` are
    :func:`arborl.rewards.outcome.turn_rewards` (process reward of each turn, the outcome R added to the
    last turn), so p is ``turns`` with R taken off the last turn. 0 on padding."""
    p, m = as_turns(turns, None)
    p = p.to(torch.float64).clone()
    r = _as_f64(rewards)[0].reshape(-1)
    if p.shape[0] != r.numel():
        raise ValueError(f"{p.shape[0]} episodes of turn rewards but {r.numel()} outcome rewards")
    last = m.sum(dim=1) - 1
    rows = (last >= 0).nonzero().flatten()
    p[rows, last[rows]] -= r[rows]
    return torch.where(m, p, 0.0), m


def process_advantages(
    process: Tensor,
    turn_mask: Tensor,
    group_ids: GroupIds | None,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    r"""Group-normalised process rewards, one per turn (C1 under a per-episode estimator):

        P_{n,k} = (p_{n,k} - mean_{g(n)} p) / (std_{g(n)} p + eps)

    mean and std pooled over every turn of every episode of the group (``group_ids`` None: over the
    whole batch); without ``std_normalize`` only the mean is subtracted. A group whose process rewards
    are all equal (e.g. all 0) gets P = 0. Returns [N, K], 0 on padding."""
    ids = [0] * process.shape[0] if group_ids is None else group_ids
    return subtract_baseline(process, ids, turn_mask=turn_mask, std_normalize=std_normalize, eps=eps,
                             unbiased=unbiased)


def has_process_rewards(rewards: Tensor, turns: TurnRewards) -> bool:
    """True when any episode carries a non-zero process reward."""
    return bool((process_rewards(rewards, turns)[0] != 0).any())
