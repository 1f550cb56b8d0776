r"""The registered policy-gradient token losses: one function under its formula per ``train.loss.kind``,
each with its own settings (verl's core_algos style).

Notation: tensors are batch-first, B samples x T tokens; logp_t (current, with grad), old_t (pi_old),
A_t (advantage [B, T]), mask m_t; d_t = logp_t - old_t, rho_t = exp(d_t) (:mod:`arborl.train.ratio`:
clamped); n_i = sum_t m_{i,t}; sg = stop-gradient. Every function returns a per-token loss to MINIMISE
[B, T] (:func:`arborl.train.losses.policy_loss` aggregates it with ``train.loss.aggregation``) and the
bool masks of tokens whose clip (or selection) is active:

    ppo       l_t = max(-A rho, -A clip(rho, 1-e_l, 1+e_h))   (+ dual-clip)
    cispo     l_t = -sg(clip(rho, 1-e_l, 1+e_h)) A logp_t
    sft       l_t = -A logp_t
    gspo      s_i = exp(1/n_i sum_t d_t)            l_t = max(-A s, -A clip(s, 1-e_l, 1+e_h))
    gmpo      c_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -e_l, e_h)),  R_i = exp(1/n_i sum_t c_t),  l_t = -A R
    sapo      g_t = 4/tau sigmoid(tau (rho_t - 1)), tau = tau_pos if A > 0 else tau_neg,   l_t = -A g
    clip_cov  PPO-clip, with the k highest-covariance tokens in (lb, ub) detached
    kl_cov    l_t = -A rho_t (+ coef |d_t| on the k highest-covariance tokens)
    ipa       rho_c = exp(mean_{t in c} d_t) per chunk c, PPO-clip on rho_c, chunks with a large
              train/rollout mismatch masked (C4, ROLL's IPA)

cov_t = (A_t - mean A)(logp_t - mean logp) over the loss tokens of the (micro-)batch the loss sees.

**One loss = one function + its settings.** A loss's own knobs are the fields of a small pydantic
model, its ``Settings`` attribute (``@with_settings(Model)``, config/kinds.py), set under
``train.loss.settings`` and validated when the config is checked; they reach the function as keyword
arguments of the same names. A setting's default is written once, in the model: the function's
keywords have none, and ``with_settings`` fills the ones a caller leaves out.
The function also gets, as keywords, those of ``mask`` (bool [B, T]), ``chunk_ids`` and
``rollout_logprobs`` ([B, T]) its signature names. A user's ``module:attr`` / ``file.py:attr`` loss
works the same way (a ``Settings`` attribute, or none: no settings).

The sequence-level ratios (gspo, gmpo) are written in the "token form" (the GSPO-token variant of
Zheng et al. 2025): every token's ratio has its sequence's value and the gradient of its own log-prob
times that value, so per-token (per-chunk) advantages work and, with a constant advantage per sample,
the gradient equals the paper's sequence-level objective under any aggregation. ipa's chunk ratio
carries the gradient of the chunk's mean log-ratio, as ROLL's.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Protocol

import torch
from pydantic import Field
from torch import Tensor

from arborl.config.kinds import KindSettings, with_settings
from arborl.registry import Registry
from arborl.train.ratio import chunk_mean, clamp_log_ratio, importance_ratio

Clipped = dict[str, Tensor]


class TokenLoss(Protocol):
    """A policy-gradient token loss (``train.loss.kind``): (logp, old_logp, advantages [B, T], its settings
    and those of ``mask`` / ``chunk_ids`` / ``rollout_logprobs`` its signature names, as keywords) ->
    (per-token loss to minimise [B, T], {name: bool mask of tokens whose clip is active}; names "high",
    "low", "dual" are logged as clip fractions, others as loss/<name>_frac). Optional ``Settings``: the
    pydantic model of its settings."""

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, **options: Any) -> tuple[Tensor, Clipped]: ...


POLICY_LOSSES: Registry[TokenLoss] = Registry("policy loss")


LossSettings = KindSettings  # base of a built-in loss's settings: typed, frozen, unknown keys refused


def _need_mask(kind: str, mask: Tensor | None) -> Tensor:
    if mask is None:
        raise ValueError(f"policy loss {kind!r} needs the loss mask (mask=[B, T]); policy_loss passes it")
    return mask > 0


def _seq_mean(x: Tensor, m: Tensor) -> Tensor:
    """Mean of x over each row's loss tokens, [B, 1] (0 for an empty row)."""
    mf = m.to(x.dtype)
    return (torch.where(m, x, 0.0) * mf).sum(-1, keepdim=True) / mf.sum(-1, keepdim=True).clamp(min=1)


def _unit_ratio(unit_log: Tensor, token_log: Tensor) -> Tensor:
    """Token-form ratio: value exp(unit_log), gradient exp(unit_log) * grad(token_log)."""
    return torch.exp(clamp_log_ratio(unit_log.detach()) + token_log - token_log.detach())


def _clip_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Clipped]:
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high))
    r = ratio.detach()
    return loss, {"high": (adv > 0) & (r > 1.0 + high), "low": (adv < 0) & (r < 1.0 - low)}


def _covariance(logp: Tensor, adv: Tensor, m: Tensor) -> Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp) over the loss tokens (no gradient); -inf off the mask."""
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        lp, a = logp.detach(), adv.detach()
        cov = (a - torch.where(m, a, 0.0).sum() / n) * (lp - torch.where(m, lp, 0.0).sum() / n)
        return torch.where(m, cov, -torch.inf)


def _top(cov: Tensor, candidates: Tensor, frac: float, m: Tensor) -> Tensor:
    """Bool [B, T]: the max(1, floor(frac * loss tokens)) candidates with the highest covariance."""
    k = min(max(1, int(frac * int(m.sum()))), int(candidates.sum()))
    picked = torch.zeros_like(candidates)
    if k > 0:
        flat = torch.where(candidates, cov, -torch.inf).reshape(-1)
        picked.view(-1)[torch.topk(flat, k).indices] = True
    return picked


INERT = "inert while the ratio is 1, see train.loss.kind"


# ----------------------------------------------------------------------------- PPO


class PPOSettings(LossSettings):
    """ppo: token-level PPO-clip, asymmetric range (DAPO clip-higher), optional dual-clip."""

    clip_low: float = Field(0.2, ge=0, lt=1, description=f"ratio lower clip 1 - clip_low (ratio units; {INERT})")
    clip_high: float = Field(
        0.28, ge=0, description=f"ratio upper clip 1 + clip_high (ratio units; > clip_low is DAPO's clip-higher; {INERT})"
    )
    dual_clip: float | None = Field(
        None, gt=1, description="dual-clip constant c > 1 bounding the loss of negative-advantage tokens at c|A| "
        f"(None = off; {INERT})"
    )


@POLICY_LOSSES.register("ppo")
@with_settings(PPOSettings)
def ppo_clip_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, Clipped]:
    r"""PPO-clip (Schulman et al. 2017) at token level, asymmetric range (DAPO clip-higher, Yu et
    al. 2025: eps_high > eps_low keeps exploration tokens alive), optional dual-clip (Ye et al. 2020):

        l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
        l_t = min(l_t, -c A_t)                        if A_t < 0 and dual_clip = c > 1

    The gradient is zero on the clipped side: A > 0 and rho > 1 + eps_high; A < 0 and rho < 1 - eps_low;
    A < 0 and rho > c (dual-clip: a bad token far above old policy cannot push an unbounded update).
    Returns (l [B, T], {"high", "low", "dual"}: bool [B, T] where that clip is active).
    """
    ratio = importance_ratio(logp, old_logp)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    dual = torch.zeros_like(ratio, dtype=torch.bool)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
        dual = (adv < 0) & (ratio > dual_clip)
    clipped = {"high": (adv > 0) & (ratio > 1.0 + clip_high), "low": (adv < 0) & (ratio < 1.0 - clip_low), "dual": dual}
    return loss, clipped


# ----------------------------------------------------------------------------- CISPO


class CISPOSettings(LossSettings):
    """cispo: MiniMax-M1's clipped importance weight (stop-gradient) x advantage x log-prob."""

    eps_high: float = Field(0.28, ge=0, description=f"the IS weight is clipped at 1 + eps_high (ratio units; {INERT})")
    eps_low: float | None = Field(
        None, ge=0, lt=1, description="lower clip 1 - eps_low of the IS weight (None = no lower bound, as MiniMax; "
        f"{INERT})"
    )


@POLICY_LOSSES.register("cispo")
@with_settings(CISPOSettings)
def cispo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    *,
    eps_high: float,
    eps_low: float | None,
) -> tuple[Tensor, Clipped]:
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
    ratio = importance_ratio(logp, old_logp).detach()
    weight = ratio.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)
    loss = -weight * adv * logp
    low = torch.zeros_like(ratio, dtype=torch.bool) if eps_low is None else ratio < 1.0 - eps_low
    return loss, {"high": ratio > 1.0 + eps_high, "low": low}


# ----------------------------------------------------------------------------- SFT


@POLICY_LOSSES.register("sft")
def sft_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor) -> tuple[Tensor, Clipped]:
    """Supervised fine-tuning: l_t = -A_t * logp_t, the negative log-likelihood of the target tokens
    (A_t = 1 on a demonstration; a per-token weight otherwise). No ratio, no clip, no settings."""
    return -adv * logp, {}


# ----------------------------------------------------------------------------- GSPO


class GSPOSettings(LossSettings):
    """gspo: the sequence-level ratio (geometric mean of the token ratios per sample), clipped."""

    clip_low: float = Field(
        3e-4, ge=0, lt=1, description=f"sequence ratio lower clip 1 - clip_low (ratio units; the paper's 3e-4; {INERT})"
    )
    clip_high: float = Field(
        4e-4, ge=0, description=f"sequence ratio upper clip 1 + clip_high (ratio units; the paper's 4e-4; {INERT})"
    )


@POLICY_LOSSES.register("gspo")
@with_settings(GSPOSettings)
def gspo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
                    clip_high: float) -> tuple[Tensor, Clipped]:
    r"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071):

        s_i(theta) = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(1/|y_i| sum_t d_t)
        J = E[ 1/G sum_i min(s_i A_i, clip(s_i, 1 - e_l, 1 + e_h) A_i) ]

    as GSPO-token: s_{i,t} = sg(s_i) pi_theta(y_t) / sg(pi_theta(y_t)). The paper's J is
    ``aggregation="seq_mean"``; its clip range is tiny (3e-4, 4e-4) because s_i averages the tokens.
    """
    m = _need_mask("gspo", mask)
    s = _unit_ratio(_seq_mean(logp - old_logp, m).expand_as(logp), logp)
    return _clip_surrogate(s, adv, clip_low, clip_high)


# ----------------------------------------------------------------------------- GMPO


class GMPOSettings(LossSettings):
    """gmpo: the geometric mean of the token ratios, each clipped in log space."""

    clip_low: float = Field(
        0.4, ge=0, description="token log-ratios are clipped below at -clip_low (log-ratio units, i.e. ratio e^-0.4; "
        f"{INERT})"
    )
    clip_high: float = Field(0.4, ge=0, description=f"token log-ratios are clipped above at +clip_high (log-ratio units; {INERT})")


@POLICY_LOSSES.register("gmpo")
@with_settings(GMPOSettings)
def gmpo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
                    clip_high: float) -> tuple[Tensor, Clipped]:
    r"""GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): the geometric
    mean of the clipped token objectives, the clip taken in log space:

        J = E[ 1/G sum_i ( prod_t |min(rho_t A_i, clip(rho_t, e^-e_l, e^e_h) A_i)| )^(1/|o_i|) sgn(A_i) ]
          = E[ 1/G sum_i A_i exp(1/|o_i| sum_t c_t) ],  c_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -e_l, e_h))

    Token form: l_t = -A_t sg(R_i) exp(c_t - sg(c_t)); each token uses its own advantage's sign (equal
    to the paper when A is constant per sample). The paper's J is ``aggregation="seq_mean"``.
    """
    m = _need_mask("gmpo", mask)
    d = clamp_log_ratio(logp - old_logp)
    sgn = torch.sign(adv)
    c = sgn * torch.minimum(sgn * d, sgn * d.clamp(-clip_low, clip_high))
    ratio = _unit_ratio(_seq_mean(c, m).expand_as(c), c)
    dd = d.detach()
    return -adv * ratio, {"high": (adv > 0) & (dd > clip_high), "low": (adv < 0) & (dd < -clip_low)}


# ----------------------------------------------------------------------------- SAPO


class SAPOSettings(LossSettings):
    """sapo: a sigmoid soft gate instead of the hard clip."""

    tau_pos: float = Field(
        1.0, gt=0, description="gate temperature for positive advantages; larger = faster decay away from ratio 1 "
        "(inert while the ratio is 1, where the gate's slope is 1 for any temperature)"
    )
    tau_neg: float = Field(1.05, gt=0, description=f"gate temperature for negative (and zero) advantages ({INERT})")


@POLICY_LOSSES.register("sapo")
@with_settings(SAPOSettings)
def sapo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, *, tau_pos: float,
                    tau_neg: float) -> tuple[Tensor, Clipped]:
    r"""SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a smooth
    gate replaces the hard clip,

        f(rho) = 4/tau sigmoid(tau (rho - 1)),   tau = tau_pos if A > 0 else tau_neg
        J = E[ 1/G sum_i 1/|y_i| sum_t f(rho_{i,t}) A_{i,t} ]            (aggregation="seq_mean")

    d f / d rho = 4 sigmoid'(tau (rho - 1)) is 1 at rho = 1 (the plain policy gradient on-policy) and
    decays as rho leaves 1, faster for larger tau; the paper sets tau_neg > tau_pos because negative
    updates spread to many unsampled tokens. No hard clip: the clip masks are empty.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO temperatures must be > 0; got {tau_pos}, {tau_neg}")
    ratio = importance_ratio(logp, old_logp)
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -adv * gate, {}


# ----------------------------------------------------------------------------- Clip-Cov / KL-Cov


class ClipCovSettings(LossSettings):
    """clip_cov: PPO-clip with the few highest log-prob x advantage covariance tokens detached (Cui et al. 2025)."""

    clip_low: float = Field(0.2, ge=0, lt=1, description=f"PPO ratio lower clip 1 - clip_low (ratio units; {INERT})")
    clip_high: float = Field(0.28, ge=0, description=f"PPO ratio upper clip 1 + clip_high (ratio units; {INERT})")
    frac: float = Field(
        2e-4, gt=0, le=1, description="fraction of a micro-batch's loss tokens (at least 1) whose gradient is detached: "
        "the highest log-prob x advantage covariance among tokens inside [lb, ub]"
    )
    lb: float = Field(1.0, description="a token is a candidate only if its covariance is above this (covariance units)")
    ub: float = Field(5.0, description="a token is a candidate only if its covariance is below this (covariance units)")


@POLICY_LOSSES.register("clip_cov")
@with_settings(ClipCovSettings)
def clip_cov_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
                        clip_high: float, frac: float, lb: float,
                        ub: float) -> tuple[Tensor, Clipped]:
    r"""Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv:2505.22617, sec. 4): entropy collapses through the tokens whose log-prob and advantage
    co-vary most, so detach the gradient of a small fraction of them:

        l_t = max(-A rho, -A clip(rho, 1 - e_l, 1 + e_h))            PPO-clip
        I   = top max(1, floor(frac N)) of { t : lb < cov_t < ub, PPO clip not active at t }
        l_t = sg(l_t) for t in I

    The paper (and verl) draws I at random among the candidates; here it is the highest-covariance
    candidates, so a step is deterministic. ``"cov"`` in the returned masks marks I.
    """
    m = _need_mask("clip_cov", mask)
    ratio = importance_ratio(logp, old_logp)
    unclipped, clipped_loss = -adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    cov = _covariance(logp, adv, m)
    picked = _top(cov, m & (cov > lb) & (cov < ub) & ~(clipped_loss > unclipped), frac, m)
    r = ratio.detach()
    return torch.where(picked, loss.detach(), loss), {
        "high": (adv > 0) & (r > 1.0 + clip_high), "low": (adv < 0) & (r < 1.0 - clip_low), "cov": picked}


class KLCovSettings(LossSettings):
    """kl_cov: plain policy gradient with a |log ratio| penalty on the highest-covariance tokens (Cui et al. 2025)."""

    frac: float = Field(
        2e-4, gt=0, le=1, description="fraction of a micro-batch's loss tokens (at least 1), the highest log-prob x "
        f"advantage covariance, that get the |log ratio| penalty ({INERT})"
    )
    coef: float = Field(
        1.0, ge=0, description="weight of the |log pi - log pi_old| penalty on the selected tokens (inert while the "
        "ratio is 1, where the penalty's gradient is 0)"
    )


@POLICY_LOSSES.register("kl_cov")
@with_settings(KLCovSettings)
def kl_cov_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, frac: float,
                      coef: float) -> tuple[Tensor, Clipped]:
    r"""KL-Cov (Cui et al. 2025, arXiv:2505.22617, sec. 4): no clip; the top covariance tokens get a
    penalty on how far the policy moved from pi_old there:

        l_t = -A rho_t + coef |d_t| 1[t in top max(1, floor(frac N)) of cov_t]

    ``"cov"`` in the returned masks marks the penalised tokens.
    """
    m = _need_mask("kl_cov", mask)
    ratio = importance_ratio(logp, old_logp)
    cov = _covariance(logp, adv, m)
    picked = _top(cov, m, frac, m)
    penalty = coef * clamp_log_ratio(logp - old_logp).abs()
    return -adv * ratio + torch.where(picked, penalty, 0.0), {"cov": picked}


# ----------------------------------------------------------------------------- IPA (C4)


class IPASettings(LossSettings):
    """ipa: ROLL's chunk-level ratio, PPO-clipped, with a chunk train/rollout mismatch mask (C4)."""

    clip_low: float = Field(0.2, ge=0, lt=1, description=f"chunk ratio lower clip 1 - clip_low (ratio units; {INERT})")
    clip_high: float = Field(0.28, ge=0, description=f"chunk ratio upper clip 1 + clip_high (ratio units; {INERT})")
    mask_threshold: float = Field(
        2.0, gt=1, description="H; a chunk whose train/rollout mismatch (geometric mean of pi_train / pi_rollout over "
        "its tokens) is above H or below 1/H is masked, on the sides mask_sides says (ratio units)"
    )
    mask_sides: Literal["sign", "both"] = Field(
        "sign", description="sign = a positive-advantage chunk is masked when its mismatch > H, a negative one when "
        "< 1/H (the side where the update would grow); both = either side masks any chunk"
    )


@POLICY_LOSSES.register("ipa")
@with_settings(IPASettings)
def ipa_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, chunk_ids: Tensor,
                   rollout_logprobs: Tensor, *, clip_low: float, clip_high: float,
                   mask_threshold: float, mask_sides: str) -> tuple[Tensor, Clipped]:
    r"""IPA's chunk-level policy loss (ROLL, "Let It Flow", arXiv:2512.24873; chunks are the spans
    between environment interactions, ``Sample.chunk_ids``):

        rho_c = (prod_{t in c} pi_theta(y_t) / pi_old(y_t))^(1/|c|) = exp(mean_{t in c} d_t)
        l_t   = max(-A rho_c, -A clip(rho_c, 1 - e_l, 1 + e_h))              t in chunk c
        mu_c  = exp(mean_{t in c} (sg(logp_t) - rollout_logp_t))                train / rollout mismatch
        M_c   = 0 if the chunk's mismatch is too large, else 1;   l_t <- M_c l_t

    The ratio's gradient flows through the chunk mean (as ROLL's "segment" ratio). Positive and
    negative trajectories (the sign of the chunk's advantage; chunk_returns advantages are
    group-relative) are masked on different sides with ``mask_sides="sign"``: a positive chunk when
    mu_c > H = ``mask_threshold`` (the trainer already rates it far above the sampler, reinforcing it would push further
    off the rollout distribution), a negative one when mu_c < 1/H (pushing down tokens the trainer
    already finds unlikely gives the large, unstable negative gradients). ``mask_sides="both"`` masks
    either side for every chunk. This sign rule is our reading of the paper's treatment of positive
    and negative trajectories; ``"mismatch"`` in the returned masks marks masked tokens.
    """
    m = _need_mask("ipa", mask)
    if chunk_ids is None or rollout_logprobs is None:
        raise ValueError("policy loss 'ipa' needs chunk_ids and rollout_logprobs [B, T]; policy_loss passes them")
    if mask_threshold <= 1.0 or mask_sides not in ("sign", "both"):
        raise ValueError(f"ipa needs mask_threshold H > 1 and mask_sides in sign, both; got {mask_threshold}, {mask_sides!r}")
    ratio = torch.exp(clamp_log_ratio(chunk_mean(logp - old_logp, m, chunk_ids)))
    loss, clipped = _clip_surrogate(ratio, adv, clip_low, clip_high)
    with torch.no_grad():
        rollout_logprobs = torch.where(m, rollout_logprobs.to(logp.dtype), 0.0)
        mis = chunk_mean(torch.where(m, logp.detach() - rollout_logprobs, 0.0), m, chunk_ids)
        over, under = mis > math.log(mask_threshold), mis < -math.log(mask_threshold)
        masked = ((adv > 0) & over) | ((adv < 0) & under) if mask_sides == "sign" else over | under
        masked = masked & m
    return torch.where(masked, 0.0, loss), {**clipped, "mismatch": masked}
