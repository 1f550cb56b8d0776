r"""The registered policy losses beyond PPO and CISPO, each under its formula (verl's core_algos style).

Notation as in :mod:`arborl.train.losses`: logp_t (current, with grad), old_t (pi_old), A_t, mask m_t;
d_t = logp_t - old_t, rho_t = exp(d_t); n_i = sum_t m_{i,t}; sg = stop-gradient. Every function
(registered by name in :data:`arborl.train.losses.POLICY_LOSSES`) returns a per-token loss to MINIMISE
[B, T] (the trainer aggregates it with ``train.loss.aggregation``) and the bool masks of tokens whose
clip (or selection) is active. The sequence-level ratios (gspo, gmpo) are written in the "token form"
(the GSPO-token variant of Zheng et al. 2025): every token's ratio has its sequence's value and the
gradient of its own log-prob times that value, so per-token (per-chunk) advantages work and, with a
constant advantage per sample, the gradient equals the paper's sequence-level objective under any
aggregation. ipa's chunk ratio carries the gradient of the chunk's mean log-ratio, as ROLL's.

    gspo      s_i = exp(1/n_i sum_t d_t)            l_t = max(-A s, -A clip(s, 1-e_l, 1+e_h))
    gmpo      c_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -e_l, e_h)),  R_i = exp(1/n_i sum_t c_t),  l_t = -A R
    sapo      g_t = 4/tau sigmoid(tau (rho_t - 1)), tau = tau_pos if A > 0 else tau_neg,   l_t = -A g
    clip_cov  PPO-clip, with the k highest-covariance tokens in (lb, ub) detached
    kl_cov    l_t = -A rho_t (+ coef |d_t| on the k highest-covariance tokens)
    ipa       rho_c = exp(mean_{t in c} d_t) per chunk c, PPO-clip on rho_c, chunks with a large
              train/rollout mismatch masked (C4, ROLL's IPA)

cov_t = (A_t - mean A)(logp_t - mean logp) over the loss tokens of the (micro-)batch the loss sees.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from arborl.train.corrections import LOG_RATIO_CLAMP, chunk_mean

Clipped = dict[str, Tensor]


def _ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


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
    return torch.exp(unit_log.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + token_log - token_log.detach())


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


# ----------------------------------------------------------------------------- GSPO


def gspo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 3e-4,
                    clip_high: float = 4e-4) -> tuple[Tensor, Clipped]:
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


def gmpo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 0.4,
                    clip_high: float = 0.4) -> tuple[Tensor, Clipped]:
    r"""GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): the geometric
    mean of the clipped token objectives, the clip taken in log space:

        J = E[ 1/G sum_i ( prod_t |min(rho_t A_i, clip(rho_t, e^-e_l, e^e_h) A_i)| )^(1/|o_i|) sgn(A_i) ]
          = E[ 1/G sum_i A_i exp(1/|o_i| sum_t c_t) ],  c_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -e_l, e_h))

    Token form: l_t = -A_t sg(R_i) exp(c_t - sg(c_t)); each token uses its own advantage's sign (equal
    to the paper when A is constant per sample). The paper's J is ``aggregation="seq_mean"``.
    """
    m = _need_mask("gmpo", mask)
    d = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sgn = torch.sign(adv)
    c = sgn * torch.minimum(sgn * d, sgn * d.clamp(-clip_low, clip_high))
    ratio = _unit_ratio(_seq_mean(c, m).expand_as(c), c)
    dd = d.detach()
    return -adv * ratio, {"high": (adv > 0) & (dd > clip_high), "low": (adv < 0) & (dd < -clip_low)}


# ----------------------------------------------------------------------------- SAPO


def sapo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, *, tau_pos: float = 1.0,
                    tau_neg: float = 1.05) -> tuple[Tensor, Clipped]:
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
    ratio = _ratio(logp, old_logp)
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -adv * gate, {}


# ----------------------------------------------------------------------------- Clip-Cov / KL-Cov


def clip_cov_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 0.2,
                        clip_high: float = 0.28, frac: float = 2e-4, lb: float = 1.0,
                        ub: float = 5.0) -> tuple[Tensor, Clipped]:
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
    ratio = _ratio(logp, old_logp)
    unclipped, clipped_loss = -adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    cov = _covariance(logp, adv, m)
    picked = _top(cov, m & (cov > lb) & (cov < ub) & ~(clipped_loss > unclipped), frac, m)
    r = ratio.detach()
    return torch.where(picked, loss.detach(), loss), {
        "high": (adv > 0) & (r > 1.0 + clip_high), "low": (adv < 0) & (r < 1.0 - clip_low), "cov": picked}


def kl_cov_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, frac: float = 2e-4,
                      coef: float = 1.0) -> tuple[Tensor, Clipped]:
    r"""KL-Cov (Cui et al. 2025, arXiv:2505.22617, sec. 4): no clip; the top covariance tokens get a
    penalty on how far the policy moved from pi_old there:

        l_t = -A rho_t + coef |d_t| 1[t in top max(1, floor(frac N)) of cov_t]

    ``"cov"`` in the returned masks marks the penalised tokens.
    """
    m = _need_mask("kl_cov", mask)
    ratio = _ratio(logp, old_logp)
    cov = _covariance(logp, adv, m)
    picked = _top(cov, m, frac, m)
    penalty = coef * (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).abs()
    return -adv * ratio + torch.where(picked, penalty, 0.0), {"cov": picked}


# ----------------------------------------------------------------------------- IPA (C4)


def ipa_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, chunk_ids: Tensor,
                   rollout_logprobs: Tensor, *, clip_low: float = 0.2, clip_high: float = 0.28,
                   threshold: float = 2.0, sides: str = "sign") -> tuple[Tensor, Clipped]:
    r"""IPA's chunk-level policy loss (ROLL, "Let It Flow", arXiv:2512.24873; chunks are the spans
    between environment interactions, ``Sample.chunk_ids``):

        rho_c = (prod_{t in c} pi_theta(y_t) / pi_old(y_t))^(1/|c|) = exp(mean_{t in c} d_t)
        l_t   = max(-A rho_c, -A clip(rho_c, 1 - e_l, 1 + e_h))              t in chunk c
        mu_c  = exp(mean_{t in c} (sg(logp_t) - rollout_logp_t))                train / rollout mismatch
        M_c   = 0 if the chunk's mismatch is too large, else 1;   l_t <- M_c l_t

    The ratio's gradient flows through the chunk mean (as ROLL's "segment" ratio). Positive and
    negative trajectories (the sign of the chunk's advantage; chunk_returns advantages are
    group-relative) are masked on different sides with ``sides="sign"``: a positive chunk when
    mu_c > H (the trainer already rates it far above the sampler, reinforcing it would push further
    off the rollout distribution), a negative one when mu_c < 1/H (pushing down tokens the trainer
    already finds unlikely gives the large, unstable negative gradients). ``sides="both"`` masks
    either side for every chunk. This sign rule is our reading of the paper's treatment of positive
    and negative trajectories; ``"mismatch"`` in the returned masks marks masked tokens.
    """
    m = _need_mask("ipa", mask)
    if chunk_ids is None or rollout_logprobs is None:
        raise ValueError("policy loss 'ipa' needs chunk_ids and rollout_logprobs [B, T]; policy_loss passes them")
    if threshold <= 1.0 or sides not in ("sign", "both"):
        raise ValueError(f"ipa needs threshold H > 1 and sides in sign, both; got {threshold}, {sides!r}")
    ratio = torch.exp(chunk_mean(logp - old_logp, m, chunk_ids).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, clipped = _clip_surrogate(ratio, adv, clip_low, clip_high)
    with torch.no_grad():
        rollout = torch.where(m, rollout_logprobs.to(logp.dtype), 0.0)
        mis = chunk_mean(torch.where(m, logp.detach() - rollout, 0.0), m, chunk_ids)
        over, under = mis > math.log(threshold), mis < -math.log(threshold)
        masked = ((adv > 0) & over) | ((adv < 0) & under) if sides == "sign" else over | under
        masked = masked & m
    return torch.where(masked, 0.0, loss), {**clipped, "mismatch": masked}
