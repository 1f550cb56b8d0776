r"""Training-inference mismatch: correction weights and metrics (seed S3; slime, verl, IcePop).

The engine and the trainer compute log-probs of the same tokens with different kernels, precision
and batching (asynchronously, even different weights): tokens come from pi_rollout while the
gradient is taken for pi_train. Per loss token

    rho_t = pi_train(o_t) / pi_rollout(o_t) = exp(train_logp_t - rollout_logp_t)

``level`` picks the unit that shares one ratio:

    token:      rho_t
    sequence:   rho_seq = prod_t rho_t = exp(sum_t log rho_t)              exact, high variance
    geometric:  rho_geo = exp(mean_t log rho_t)                            length-normalised
    chunk:      rho_c   = exp(mean_{t in chunk c} log rho_t)               C4: per span between env interactions

``mode`` turns the unit's ratio rho into the weight w of each of its tokens:

    none:    w = 1                                    (metrics only)
    tis:     w = min(rho, C)                          truncated IS (Yao et al. 2025, "Your efficient RL
                                                      framework secretly brings you off-policy RL training")
    mis:     w = rho * 1[low <= rho <= high]          masked IS (Liu, Li et al. 2025, "When speed kills
                                                      stability"); low = 0 makes it one-sided
    icepop:  w_t = rho_t * 1[low <= rho_t <= high]    IcePop (Ring-1T, 2025): mis at token level only

and in every mode a ``veto`` sets w = 0 on every token of a sample that holds a token with
rho_t < veto (a token the trainer finds near-impossible signals a broken sample).

The weights multiply the per-token policy-gradient loss (``policy_loss(weights=...)``); they carry
no gradient. Compare like with like: ``rollout_logprobs`` are the engine's raw temperature-1
log-probs (``Sample.rollout_logprobs``), not the sampling-distribution ``sample_logprobs`` (a tempered
trainer, which scores softmax(logits / T), passes those as its ``rollout_logprobs``:
``Sample.behaviour_logprobs``).

``rollout_correction(..., **cfg.train.correction.model_dump())`` works: its keyword names are the
fields of :class:`arborl.config.CorrectionConfig`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from arborl.train.ratio import chunk_mean, clamp_log_ratio

Mode = Literal["none", "tis", "mis", "icepop"]
Level = Literal["token", "sequence", "geometric", "chunk"]


def rollout_correction(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: Mode = "none",
    level: Level = "token",
    tis_cap: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 5.0,
    veto: float | None = None,
    chunk_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""Per-token correction weights [B, T] (detached, 0 off the mask) and the mismatch metrics.

    ``train_logprobs`` / ``rollout_logprobs`` [B, T]: the trainer's recomputed and the engine's
    log-probs of the same tokens; ``mask`` [B, T]: loss mask. ``chunk_ids`` [B, T] only for
    level="chunk". Formulas: see the module docstring.

    Metrics, always (python floats over the loss tokens; 0 when there are none):
      mismatch/k3_kl               mean_t (rho_t - 1 - log rho_t): k3 estimate of KL(rollout || train)
      mismatch/logp_abs_diff_mean  mean_t |train_logp_t - rollout_logp_t|
      mismatch/logp_abs_diff_max   max_t  |train_logp_t - rollout_logp_t|
      mismatch/ratio_mean, _min, _max   token ratios rho_t
      mismatch/masked_frac         fraction of loss tokens whose weight is 0 (mis / icepop / veto)
      mismatch/truncated_frac      fraction of loss tokens whose unit ratio exceeds C (tis)
      mismatch/veto_frac           fraction of non-empty samples vetoed
      mismatch/weight_mean         mean weight of the loss tokens
      mismatch/tokens              number of loss tokens
    """
    if mode not in ("none", "tis", "mis", "icepop"):
        raise ValueError(f"mode must be one of none, tis, mis, icepop; got {mode!r}")
    if level not in ("token", "sequence", "geometric", "chunk"):
        raise ValueError(f"level must be one of token, sequence, geometric, chunk; got {level!r}")
    if mode == "icepop" and level != "token":
        raise ValueError(f"icepop is token-level by definition (got level={level!r}); use mode='mis' for other levels")
    if mode == "tis" and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if mode in ("mis", "icepop") and not 0 <= mask_low < mask_high:
        raise ValueError(f"need 0 <= mask_low < mask_high, got {mask_low}, {mask_high}")
    if veto is not None and not veto > 0:
        raise ValueError(f"veto must be > 0 (or None), got {veto}")
    if level == "chunk" and chunk_ids is None:
        raise ValueError("level='chunk' needs chunk_ids [B, T]")

    with torch.no_grad():
        m = mask > 0
        mf = m.to(train_logprobs.dtype)
        log_ratio = torch.where(m, train_logprobs.detach() - rollout_logprobs.detach(), 0.0)

        # the unit's log-ratio, broadcast onto its tokens
        if level == "token":
            unit = log_ratio
        elif level == "sequence":
            unit = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        elif level == "geometric":
            unit = (log_ratio.sum(-1, keepdim=True) / mf.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
        else:
            unit = chunk_mean(log_ratio, m, chunk_ids)
        rho = torch.exp(clamp_log_ratio(unit))

        if mode == "none":
            weights = torch.ones_like(rho)
        elif mode == "tis":
            weights = rho.clamp(max=tis_cap)
        else:
            weights = torch.where((rho >= mask_low) & (rho <= mask_high), rho, 0.0)

        vetoed = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
        if veto is not None:
            vetoed = (m & (log_ratio < math.log(veto))).any(-1)
            weights = torch.where(vetoed[:, None], 0.0, weights)
        weights = torch.where(m, weights, 0.0)

        # metrics, in float64
        n = int(m.sum())
        lr = log_ratio.double()[m]
        nonempty = int(m.any(-1).sum())
        if n:
            tok_rho = lr.exp()
            metrics = {
                "mismatch/k3_kl": float((tok_rho - 1.0 - lr).mean()),
                "mismatch/logp_abs_diff_mean": float(lr.abs().mean()),
                "mismatch/logp_abs_diff_max": float(lr.abs().max()),
                "mismatch/ratio_mean": float(tok_rho.mean()),
                "mismatch/ratio_min": float(tok_rho.min()),
                "mismatch/ratio_max": float(tok_rho.max()),
                "mismatch/masked_frac": float((weights[m] == 0).sum()) / n,
                "mismatch/truncated_frac": float((rho[m] > tis_cap).sum()) / n if mode == "tis" else 0.0,
                "mismatch/veto_frac": float(vetoed.sum()) / max(nonempty, 1),
                "mismatch/weight_mean": float(weights.double()[m].mean()),
                "mismatch/tokens": float(n),
            }
        else:
            metrics = {k: 0.0 for k in _METRIC_KEYS}
    return weights, metrics


_METRIC_KEYS = (
    "mismatch/k3_kl",
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "mismatch/ratio_mean",
    "mismatch/ratio_min",
    "mismatch/ratio_max",
    "mismatch/masked_frac",
    "mismatch/truncated_frac",
    "mismatch/veto_frac",
    "mismatch/weight_mean",
    "mismatch/tokens",
)


def decoupled_weights(
    proximal_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, cap: float | None = 5.0
) -> tuple[Tensor, dict[str, float]]:
    r"""Decoupled PPO's behaviour weight (AReaL, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning"; Hilton et al. 2022, "Batch size-invariance
    for policy optimization"): stale tokens come from pi_behav, the loss is clipped around the proximal
    policy pi_prox (the trainer at the start of the step) and each token is re-weighted

        w_t = pi_prox(o_t) / pi_behav(o_t) = exp(prox_logp_t - behav_logp_t),   w_t = 0 if w_t > cap

    (``proximal_logprobs``: log pi_prox; ``rollout_logprobs``: log pi_behav, the samples'; the cap is AReaL's
    ``behav_imp_weight_cap``: such tokens are dropped, not truncated). Returns (w [B, T], detached, 0 off the
    mask; metrics decoupled/weight_mean, _max, masked_frac, k3_kl = KL(behav || prox)).
    """
    if cap is not None and not cap > 0:
        raise ValueError(f"the decoupled weight cap must be > 0 (or None), got {cap}")
    with torch.no_grad():
        m = mask > 0
        log_w = torch.where(m, proximal_logprobs.detach() - rollout_logprobs.detach(), 0.0)
        w = torch.exp(clamp_log_ratio(log_w))
        dropped = m & (w > cap) if cap is not None else torch.zeros_like(m)
        w = torch.where(m & ~dropped, w, 0.0)
        n = int(m.sum())
        lw = log_w.double()[m]
        metrics = {
            "decoupled/weight_mean": float(w.double()[m].mean()) if n else 0.0,
            "decoupled/weight_max": float(w.double()[m].max()) if n else 0.0,
            "decoupled/masked_frac": float(dropped.sum()) / n if n else 0.0,
            "decoupled/k3_kl": float((lw.exp() - 1.0 - lw).mean()) if n else 0.0,
        }
    return w, metrics
