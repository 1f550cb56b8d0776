r"""The importance ratio and its one clamp, shared by the losses (losses.py, policy_losses.py) and the
mismatch corrections (corrections.py).

    d_t   = logp_t - old_logp_t                     log-ratio of one token
    rho_t = exp(clamp(d_t, -20, 20))                in [2e-9, 5e8]: never inf, never a NaN downstream

A unit's log-ratio (a sequence's mean, a chunk's mean) is clamped the same way before its exp.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # log-ratios are clamped to [-20, 20] before exp


def clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """``log_ratio`` clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """rho = exp(clamp(logp - old_logp)), per token; differentiable in both."""
    return torch.exp(clamp_log_ratio(logp - old_logp))


def chunk_mean(log_ratio: Tensor, m: Tensor, chunk_ids: Tensor) -> Tensor:
    """Mean of log_ratio over the loss tokens of each (sample, chunk), broadcast back to [B, T]; differentiable
    in log_ratio (the IPA loss takes its chunk ratio through it, the chunk-level correction its weight)."""
    c = torch.where(m, torch.as_tensor(chunk_ids, device=log_ratio.device).long(), 0)
    if bool((c < 0).any()):
        raise ValueError("chunk_ids of loss tokens must be >= 0")
    b, _ = m.shape
    k = int(c.max()) + 1 if c.numel() else 1
    flat = (torch.arange(b, device=c.device)[:, None] * k + c).reshape(-1)
    mf = m.to(log_ratio.dtype).reshape(-1)
    sums = log_ratio.new_zeros(b * k).index_add_(0, flat, log_ratio.reshape(-1) * mf)
    counts = log_ratio.new_zeros(b * k).index_add_(0, flat, mf)
    return (sums / counts.clamp(min=1))[flat].reshape(m.shape)
