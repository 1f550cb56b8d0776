r"""The trainer's loss: per-token pieces, aggregation and :func:`policy_loss` (CleanRL style: each a
few lines under its formula). The registered token losses (``train.loss.kind``: ppo, cispo, gspo, ...)
and their settings are in :mod:`arborl.train.policy_losses`.

Notation: tensors are batch-first, B samples x T tokens.

    logp_t      log pi_theta(o_t | q, o_<t)   current policy (carries the gradient)     [B, T]
    old_logp_t  log pi_old(o_t | q, o_<t)     the policy the ratio is taken against     [B, T]
    rho_t       exp(logp_t - old_logp_t)      per-token importance ratio (train/ratio.py)
    A_t         advantage                     [B, T] (or [B]: one per sample)
    m_t         loss mask, 1 only on model-generated tokens
    w_t         importance weight from :mod:`arborl.train.corrections` (no gradient)

:func:`aggregate` reduces a per-token loss to the scalar; :func:`policy_loss` is what the trainer calls
with the config section ``train.loss`` and the tensors:

    L = agg(w * l^pg) + kl_coef * agg(k(logp, ref_logp)) - entropy_coef * agg(H)

Numerics: log-ratios are clamped to [-20, 20] before exp (rho in [2e-9, 5e8]); off-mask positions
are replaced before any exp and selected away with ``torch.where``, so garbage or inf there can
never leak a NaN into the loss or its gradient. An all-masked batch gives loss 0 and zero grads.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from arborl.config import LossConfig
from arborl.config.kinds import named_context, resolve_kind
from arborl.train.policy_losses import POLICY_LOSSES, TokenLoss
from arborl.train.ratio import clamp_log_ratio, importance_ratio

Aggregation = Literal["token_mean", "seq_mean", "constant"]
KLEstimator = Literal["k1", "k2", "k3"]


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


# ----------------------------------------------------------------------------- from logits


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    r"""log p(target) = z_target - logsumexp(z), per position: logits [B, T, V], targets [B, T] -> [B, T].

    ``logits[b, t]`` must already be the distribution of ``targets[b, t]`` (for a causal LM, shift:
    logits[:, :-1] predict ids[:, 1:]). Computed in float32 at least (bf16 logits are upcast).
    """
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    r"""H_t = -sum_v p_v log p_v with p = softmax(logits_t): [B, T, V] -> [B, T]. -inf logits give 0, not NaN."""
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


# ----------------------------------------------------------------------------- KL to the reference


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    r"""Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta (Schulman 2020,
    "Approximating KL Divergence"), with log r = log pi_ref - log pi_theta:

        k1 = -log r                  unbiased, high variance, can be negative
        k2 = (log r)^2 / 2           biased, low variance
        k3 = (r - 1) - log r         unbiased, low variance, >= 0 (GRPO's choice)
    """
    _choice("kl_estimator", estimator, ("k1", "k2", "k3"))
    log_r = clamp_log_ratio(ref_logp - logp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return torch.exp(log_r) - 1.0 - log_r


# ----------------------------------------------------------------------------- aggregation


def _nonzero(x: Tensor) -> Tensor:
    return torch.where(x > 0, x, torch.ones_like(x))


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: Aggregation = "token_mean",
    *,
    constant_normalizer: float | None = None,
    num_tokens: float | None = None,
    num_samples: float | None = None,
) -> Tensor:
    r"""Reduce per-token values [B, T] to a scalar, over the tokens where ``mask`` > 0 (a float
    mask also weighs them):

        token_mean:  sum_{b,t} m l / sum_{b,t} m                 every token counts the same (DAPO, CISPO)
        seq_mean:    1/B' sum_b (sum_t m l / sum_t m)             every sample counts the same (GRPO)
        constant:    sum_{b,t} m l / (B' * L)                     Dr.GRPO: no length bias; L = constant_normalizer

    B' = samples with at least one loss token: an empty (zero-length or fully masked) sample
    contributes nothing and is not counted. ``constant_normalizer`` None means L = T, the padded
    length of ``values``; set it (e.g. to the sampling max_tokens) for a denominator that is truly
    constant across batches.

    Micro-batches: pass the whole batch's ``num_tokens`` (sum of m) and ``num_samples`` (B'); the
    sum of the micro-batch results then equals the whole batch's result. Nothing to aggregate gives
    0 (and a zero gradient), never NaN.
    """
    _choice("aggregation", mode, ("token_mean", "seq_mean", "constant"))
    m = mask.to(values.dtype)
    summed = torch.where(mask > 0, values * m, torch.zeros_like(values))

    def total(override: float | None, default: Tensor) -> Tensor:
        return default if override is None else torch.as_tensor(float(override), dtype=values.dtype)

    if mode == "token_mean":
        return summed.sum() / _nonzero(total(num_tokens, m.sum()))
    samples = total(num_samples, (m.sum(-1) > 0).sum().to(values.dtype))
    if mode == "seq_mean":
        per_sample = summed.sum(-1) / _nonzero(m.sum(-1))
        return per_sample.sum() / _nonzero(samples)
    length = float(values.shape[-1] if constant_normalizer is None else constant_normalizer)
    return summed.sum() / _nonzero(samples * length)


# ----------------------------------------------------------------------------- the trainer's loss


def _masked_stats(x: Tensor, m: Tensor) -> tuple[float, float, float]:
    """(mean, min, max) of x over m; zeros when m is empty."""
    if not bool(m.any()):
        return 0.0, 0.0, 0.0
    v = x[m]
    return float(v.mean()), float(v.min()), float(v.max())




# the tensors a token loss may ask for by naming them in its signature (besides its settings)
CONTEXT = ("mask", "chunk_ids", "rollout_logprobs")


def resolve_loss(cfg: LossConfig) -> tuple[TokenLoss, dict[str, Any]]:
    """The token loss ``cfg.kind`` names and its settings, validated by its ``Settings`` model (defaults
    filled in), as the keyword arguments it is called with. Raises :class:`ConfigError` naming the key:
    ``train.loss.kind`` (no such loss) or ``train.loss.settings.<field>`` (not one of the kind's settings,
    or a value its model refuses)."""
    return resolve_kind(POLICY_LOSSES, cfg.kind, cfg.settings, kind_key="train.loss.kind",
                        settings_key="train.loss.settings", context=CONTEXT)


def policy_loss(
    cfg: LossConfig,
    train_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    num_tokens: float | None = None,
    num_samples: float | None = None,
    chunk_ids: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""The trainer's loss on one (micro-)batch, and its metrics, under the config section ``cfg``
    (``train.loss``):

        L = agg(w * l^pg) + kl_coef * agg(k(logp, ref_logp)) - entropy_coef * agg(H)

    l^pg is the token loss registered as ``cfg.kind`` in :data:`POLICY_LOSSES` (or a ``module:attr`` /
    ``file.py:attr`` path), called with its settings ``cfg.settings`` (:func:`resolve_loss`) and the bool
    loss ``mask``, ``chunk_ids`` and the engine's ``rollout_logprobs`` (both [B, T]) where its signature
    names them; agg is :func:`aggregate` with ``cfg.aggregation`` (and the micro-batch totals
    ``num_tokens`` / ``num_samples``). w (``weights`` [B, T], e.g. from
    :func:`arborl.train.corrections.rollout_correction`) multiplies only the policy-gradient term; tokens
    it zeroes still count in the denominator.

    Inputs: ``train_logprobs`` [B, T] (the trainer's, recomputed) with grad; ``old_logprobs``, ``advantages`` ([B, T] or [B]),
    ``weights``, ``ref_logprobs`` are used without gradient; ``entropy`` [B, T] per-token entropies
    (keep their grad for the bonus), or ``logits`` [B, T, V] to compute them. ``kl_coef`` > 0 needs
    ``ref_logprobs``, ``entropy_coef`` != 0 needs ``entropy`` or ``logits``.

    Metrics (python floats, over this batch's loss tokens): loss/total, loss/pg, loss/kl (mean
    per-token KL to ref), loss/entropy, loss/clip_frac (+ _high, _low, _dual: fraction of tokens
    whose clip is active; a loss's other masks, e.g. clip_cov's "cov", as loss/<name>_frac),
    loss/approx_kl (k3 KL(old || new)), loss/ratio_mean/min/max/std (token ratios new / old), loss/tokens.
    """
    token_loss, settings = resolve_loss(cfg)
    m = mask > 0
    adv = advantages.detach()
    adv = adv[:, None].expand_as(train_logprobs) if adv.dim() == 1 else adv
    adv = torch.where(m, adv, torch.zeros_like(adv))
    logp = torch.where(m, train_logprobs, torch.zeros_like(train_logprobs))  # off the mask: logp = old = 0, ratio 1
    old = torch.where(m, old_logprobs.detach(), torch.zeros_like(logp))

    if rollout_logprobs is not None:
        rollout_logprobs = torch.where(m, rollout_logprobs.detach(), torch.zeros_like(logp))
    context = named_context(token_loss, {"mask": m, "chunk_ids": chunk_ids, "rollout_logprobs": rollout_logprobs})
    pg_tok, clipped = token_loss(logp, old, adv, **context, **settings)
    if weights is not None:
        pg_tok = pg_tok * torch.where(m, weights.detach(), torch.zeros_like(pg_tok))

    def agg(x: Tensor) -> Tensor:
        return aggregate(x, mask, cfg.aggregation, constant_normalizer=cfg.constant_normalizer, num_tokens=num_tokens,
                         num_samples=num_samples)

    pg = agg(pg_tok)
    loss = pg
    kl_tok = None
    if ref_logprobs is not None:
        kl_tok = kl_penalty(logp, torch.where(m, ref_logprobs.detach(), torch.zeros_like(logp)), cfg.kl_estimator)
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * agg(kl_tok)
    elif cfg.kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the reference policy)")
    if entropy is None and logits is not None:
        entropy = entropy_from_logits(logits)
    if entropy is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * agg(entropy)
    elif entropy is None and cfg.entropy_coef:
        raise ValueError("entropy_coef != 0 needs entropy [B, T] or logits [B, T, V]")

    with torch.no_grad():
        ratio = importance_ratio(logp.detach(), old).double()
        n = int(m.sum())
        frac = {k: float((clipped[k] & m).sum()) / max(n, 1) if k in clipped else 0.0 for k in ("high", "low", "dual")}
        other = {f"loss/{k}_frac": float((v & m).sum()) / max(n, 1) for k, v in clipped.items() if k not in frac}
        r_mean, r_min, r_max = _masked_stats(ratio, m)
        r_std = float(ratio[m].std(unbiased=False)) if n else 0.0
        metrics = {
            "loss/total": float(loss),
            "loss/pg": float(pg),
            "loss/kl": _masked_stats(kl_tok.double(), m)[0] if kl_tok is not None else 0.0,
            "loss/entropy": _masked_stats(entropy.detach().double(), m)[0] if entropy is not None else 0.0,
            "loss/clip_frac": sum(frac.values()),
            **{f"loss/clip_frac_{k}": v for k, v in frac.items()},
            "loss/approx_kl": _masked_stats(ratio - 1.0 - ratio.log(), m)[0],
            "loss/ratio_mean": r_mean,
            "loss/ratio_min": r_min,
            "loss/ratio_max": r_max,
            "loss/ratio_std": r_std,
            "loss/tokens": float(n),
            **other,
        }
    return loss, metrics
