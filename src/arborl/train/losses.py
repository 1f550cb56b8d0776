r"""Policy-gradient losses, each a few lines under its formula (CleanRL style).

Notation: tensors are batch-first, B samples x T tokens.

    logp_t      log pi_theta(o_t | q, o_<t)   current policy (carries the gradient)     [B, T]
    old_logp_t  log pi_old(o_t | q, o_<t)     the policy the ratio is taken against     [B, T]
    rho_t       exp(logp_t - old_logp_t)      per-token importance ratio
    A_t         advantage                     [B, T] (or [B]: one per sample)
    m_t         loss mask, 1 only on model-generated tokens
    w_t         importance weight from :mod:`arborl.train.corrections` (no gradient)

Every ``*_token_loss`` returns a per-token loss to MINIMISE, [B, T]; :func:`aggregate` reduces it
to the scalar; :func:`policy_loss` is what the trainer calls:

    L = agg(w * l^pg) + kl_coef * agg(k(logp, ref_logp)) - entropy_coef * agg(H)

``policy_loss(..., **cfg.train.loss.model_dump())`` works: its keyword names are the fields of
:class:`arborl.config.LossConfig`.

Numerics: log-ratios are clamped to [-20, 20] before exp (rho in [2e-9, 5e8]); off-mask positions
are replaced before any exp and selected away with ``torch.where``, so garbage or inf there can
never leak a NaN into the loss or its gradient. An all-masked batch gives loss 0 and zero grads.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from arborl.registry import Registry
from arborl.train.policy_losses import (
    clip_cov_token_loss,
    gmpo_token_loss,
    gspo_token_loss,
    ipa_token_loss,
    kl_cov_token_loss,
    sapo_token_loss,
)

Aggregation = Literal["token_mean", "seq_mean", "constant"]
KLEstimator = Literal["k1", "k2", "k3"]

LOG_RATIO_CLAMP = 20.0


def _ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


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


# ----------------------------------------------------------------------------- per-token losses


def ppo_clip_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""PPO-clip (Schulman et al. 2017) at token level, asymmetric range (DAPO clip-higher, Yu et
    al. 2025: eps_high > eps_low keeps exploration tokens alive), optional dual-clip (Ye et al. 2020):

        l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
        l_t = min(l_t, -c A_t)                        if A_t < 0 and dual_clip = c > 1

    The gradient is zero on the clipped side: A > 0 and rho > 1 + eps_high; A < 0 and rho < 1 - eps_low;
    A < 0 and rho > c (dual-clip: a bad token far above old policy cannot push an unbounded update).
    Returns (l [B, T], {"high", "low", "dual"}: bool [B, T] where that clip is active).
    """
    ratio = _ratio(logp, old_logp)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    dual = torch.zeros_like(ratio, dtype=torch.bool)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
        dual = (adv < 0) & (ratio > dual_clip)
    clipped = {"high": (adv > 0) & (ratio > 1.0 + clip_high), "low": (adv < 0) & (ratio < 1.0 - clip_low), "dual": dual}
    return loss, clipped


def cispo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    eps_high: float = 0.28,
    eps_low: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""CISPO (MiniMax-M1, arXiv:2506.13585, eqs. 4-5):

        J(theta) = E[ 1/sum_i |o_i| * sum_i sum_t sg(r^_{i,t}(theta)) * A^_{i,t} * log pi_theta(o_{i,t} | q, o_{i,<t}) ]
        r^_{i,t} = clip(r_{i,t}(theta), 1 - eps^IS_low, 1 + eps^IS_high)

    PPO clips the token's update (clipped tokens get no gradient); CISPO clips only the importance
    WEIGHT, under stop-gradient, so every token keeps its gradient:  grad l_t = -sg(r^_t) A_t grad logp_t.
    MiniMax imposes no lower bound (eps_low "set to a large value"): ``eps_low=None``. The
    1/sum|o_i| normaliser is ``aggregation="token_mean"``. The loss VALUE is a surrogate (it moves
    with logp itself); read its gradient, not its level.

        l_t = -sg(r^_t) * A_t * logp_t

    Returns (l [B, T], {"high", "low"}: bool [B, T] where the weight was clipped).
    """
    ratio = _ratio(logp, old_logp).detach()
    weight = ratio.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)
    loss = -weight * adv * logp
    low = torch.zeros_like(ratio, dtype=torch.bool) if eps_low is None else ratio < 1.0 - eps_low
    return loss, {"high": ratio > 1.0 + eps_high, "low": low}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    r"""Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta (Schulman 2020,
    "Approximating KL Divergence"), with log r = log pi_ref - log pi_theta:

        k1 = -log r                  unbiased, high variance, can be negative
        k2 = (log r)^2 / 2           biased, low variance
        k3 = (r - 1) - log r         unbiased, low variance, >= 0 (GRPO's choice)
    """
    _choice("kl_estimator", estimator, ("k1", "k2", "k3"))
    log_r = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
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


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    kind: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    cispo_eps_high: float = 0.28,
    cispo_eps_low: float | None = None,
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
    gmpo_clip_low: float = 0.4,
    gmpo_clip_high: float = 0.4,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    cov_clip_frac: float = 2e-4,
    cov_clip_lb: float = 1.0,
    cov_clip_ub: float = 5.0,
    kl_cov_frac: float = 2e-4,
    kl_cov_coef: float = 1.0,
    ipa_clip_low: float = 0.2,
    ipa_clip_high: float = 0.28,
    ipa_mask_threshold: float = 2.0,
    ipa_mask_sides: str = "sign",
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy_coef: float = 0.0,
    aggregation: Aggregation = "token_mean",
    constant_normalizer: float | None = None,
    num_tokens: float | None = None,
    num_samples: float | None = None,
    chunk_ids: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""The trainer's loss on one (micro-)batch, and its metrics:

        L = agg(w * l^pg) + kl_coef * agg(k(logp, ref_logp)) - entropy_coef * agg(H)

    l^pg is the token loss registered as ``kind`` in :data:`POLICY_LOSSES` (ppo:
    :func:`ppo_clip_token_loss`, cispo: :func:`cispo_token_loss`, gspo, gmpo, sapo, clip_cov, kl_cov,
    ipa: :mod:`arborl.train.policy_losses`, or a ``module:attr`` path); it receives every loss knob,
    the bool loss ``mask``, ``chunk_ids`` and the engine's ``rollout_logprobs`` (both [B, T], only
    the chunk-level loss ipa needs them) as keywords;
    agg is :func:`aggregate` with ``aggregation`` (and the micro-batch totals ``num_tokens`` /
    ``num_samples``). w (``weights`` [B, T], e.g. from :func:`arborl.train.corrections.rollout_correction`)
    multiplies only the policy-gradient term; tokens it zeroes still count in the denominator.

    Inputs: ``logprobs`` [B, T] with grad; ``old_logprobs``, ``advantages`` ([B, T] or [B]),
    ``weights``, ``ref_logprobs`` are used without gradient; ``entropy`` [B, T] per-token entropies
    (keep their grad for the bonus), or ``logits`` [B, T, V] to compute them. ``kl_coef`` > 0 needs
    ``ref_logprobs``, ``entropy_coef`` != 0 needs ``entropy`` or ``logits``.

    Metrics (python floats, over this batch's loss tokens): loss/total, loss/pg, loss/kl (mean
    per-token KL to ref), loss/entropy, loss/clip_frac (+ _high, _low, _dual: fraction of tokens
    whose clip is active; a loss's other masks, e.g. clip_cov's "cov", as loss/<name>_frac),
    loss/approx_kl (k3 KL(old || new)), loss/ratio_mean/min/max/std (token ratios new / old), loss/tokens.
    """
    token_loss = POLICY_LOSSES.get(kind)
    m = mask > 0
    adv = advantages.detach()
    adv = adv[:, None].expand_as(logprobs) if adv.dim() == 1 else adv
    adv = torch.where(m, adv, torch.zeros_like(adv))
    logp = torch.where(m, logprobs, torch.zeros_like(logprobs))  # off the mask: logp = old = 0, ratio 1
    old = torch.where(m, old_logprobs.detach(), torch.zeros_like(logp))

    knobs = dict(
        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, cispo_eps_high=cispo_eps_high,
        cispo_eps_low=cispo_eps_low, gspo_clip_low=gspo_clip_low, gspo_clip_high=gspo_clip_high,
        gmpo_clip_low=gmpo_clip_low, gmpo_clip_high=gmpo_clip_high, sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg, cov_clip_frac=cov_clip_frac, cov_clip_lb=cov_clip_lb, cov_clip_ub=cov_clip_ub,
        kl_cov_frac=kl_cov_frac, kl_cov_coef=kl_cov_coef, ipa_clip_low=ipa_clip_low, ipa_clip_high=ipa_clip_high,
        ipa_mask_threshold=ipa_mask_threshold, ipa_mask_sides=ipa_mask_sides,
    )
    rollout = None if rollout_logprobs is None else torch.where(m, rollout_logprobs.detach(), torch.zeros_like(logp))
    pg_tok, clipped = token_loss(logp, old, adv, mask=m, chunk_ids=chunk_ids, rollout_logprobs=rollout, **knobs)
    if weights is not None:
        pg_tok = pg_tok * torch.where(m, weights.detach(), torch.zeros_like(pg_tok))

    def agg(x: Tensor) -> Tensor:
        return aggregate(
            x, mask, aggregation, constant_normalizer=constant_normalizer, num_tokens=num_tokens, num_samples=num_samples
        )

    pg = agg(pg_tok)
    loss = pg
    kl_tok = None
    if ref_logprobs is not None:
        kl_tok = kl_penalty(logp, torch.where(m, ref_logprobs.detach(), torch.zeros_like(logp)), kl_estimator)
        if kl_coef:
            loss = loss + kl_coef * agg(kl_tok)
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the reference policy)")
    if entropy is None and logits is not None:
        entropy = entropy_from_logits(logits)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * agg(entropy)
    elif entropy is None and entropy_coef:
        raise ValueError("entropy_coef != 0 needs entropy [B, T] or logits [B, T, V]")

    with torch.no_grad():
        ratio = _ratio(logp.detach(), old).double()
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


# ----------------------------------------------------------------------------- token losses by name


class TokenLoss(Protocol):
    """A policy-gradient token loss (``train.loss.kind``): (logp, old_logp, advantages [B, T], the
    loss knobs and ``mask`` (bool [B, T]), ``chunk_ids``, ``rollout_logprobs`` as keywords; accept
    ``**_`` for the ones you do not use) -> (per-token loss to minimise [B, T], {name: bool mask of
    tokens whose clip is active}; names "high", "low", "dual" are logged as clip fractions, others as
    loss/<name>_frac)."""

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, **options: Any) -> tuple[Tensor, dict[str, Tensor]]: ...


POLICY_LOSSES: Registry[TokenLoss] = Registry("policy loss")


@POLICY_LOSSES.register("ppo")
def _ppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, clip_low: float = 0.2, clip_high: float = 0.28,
         dual_clip: float | None = None, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    return ppo_clip_token_loss(logp, old_logp, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)


@POLICY_LOSSES.register("sft")
def _sft(logp: Tensor, old_logp: Tensor, advantages: Tensor, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """Supervised fine-tuning: l_t = -A_t * logp_t, the negative log-likelihood of the target tokens
    (A_t = 1 on a demonstration; a per-token weight otherwise). No ratio, no clip."""
    return -advantages * logp, {}


@POLICY_LOSSES.register("cispo")
def _cispo(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, cispo_eps_high: float = 0.28,
           cispo_eps_low: float | None = None, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    return cispo_token_loss(logp, old_logp, advantages, eps_high=cispo_eps_high, eps_low=cispo_eps_low)


@POLICY_LOSSES.register("gspo")
def _gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, mask: Tensor | None = None,
          gspo_clip_low: float = 3e-4, gspo_clip_high: float = 4e-4, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    return gspo_token_loss(logp, old_logp, advantages, mask, clip_low=gspo_clip_low, clip_high=gspo_clip_high)


@POLICY_LOSSES.register("gmpo")
def _gmpo(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, mask: Tensor | None = None,
          gmpo_clip_low: float = 0.4, gmpo_clip_high: float = 0.4, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    return gmpo_token_loss(logp, old_logp, advantages, mask, clip_low=gmpo_clip_low, clip_high=gmpo_clip_high)


@POLICY_LOSSES.register("sapo")
def _sapo(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, sapo_tau_pos: float = 1.0,
          sapo_tau_neg: float = 1.05, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    return sapo_token_loss(logp, old_logp, advantages, tau_pos=sapo_tau_pos, tau_neg=sapo_tau_neg)


@POLICY_LOSSES.register("clip_cov")
def _clip_cov(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, mask: Tensor | None = None,
              clip_low: float = 0.2, clip_high: float = 0.28, cov_clip_frac: float = 2e-4, cov_clip_lb: float = 1.0,
              cov_clip_ub: float = 5.0, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    return clip_cov_token_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                               frac=cov_clip_frac, lb=cov_clip_lb, ub=cov_clip_ub)


@POLICY_LOSSES.register("kl_cov")
def _kl_cov(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, mask: Tensor | None = None,
            kl_cov_frac: float = 2e-4, kl_cov_coef: float = 1.0, **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    return kl_cov_token_loss(logp, old_logp, advantages, mask, frac=kl_cov_frac, coef=kl_cov_coef)


@POLICY_LOSSES.register("ipa")
def _ipa(logp: Tensor, old_logp: Tensor, advantages: Tensor, *, mask: Tensor | None = None,
         chunk_ids: Tensor | None = None, rollout_logprobs: Tensor | None = None, ipa_clip_low: float = 0.2,
         ipa_clip_high: float = 0.28, ipa_mask_threshold: float = 2.0, ipa_mask_sides: str = "sign",
         **_: Any) -> tuple[Tensor, dict[str, Tensor]]:
    return ipa_token_loss(logp, old_logp, advantages, mask, chunk_ids, rollout_logprobs, clip_low=ipa_clip_low,
                          clip_high=ipa_clip_high, threshold=ipa_mask_threshold, sides=ipa_mask_sides)
