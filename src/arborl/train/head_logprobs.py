"""Next-token log-probs and entropies from the last hidden states, chunk by chunk: the LM head's logits
of at most ``chunk`` positions exist at any time, in the forward and in the backward.

A batch of 8 transcripts x 2048 tokens over SmolLM2's 49,152-token vocabulary is 3.2 GB of float32
logits; ``log_softmax``, the softmax of the entropy and their gradients each add another copy. Here
the positions are cut into chunks; each chunk runs final norm -> LM head -> log-softmax -> the
target's log-prob (and the entropy) under ``torch.utils.checkpoint``, which keeps only the chunk's
hidden states for the backward and recomputes its logits there, one chunk at a time. The arithmetic
is the plain computation's (same formula, same dtype), so log-probs, entropies and every gradient
(LM head, tied embedding, norm, LoRA adapters below) equal it within float32 rounding; the cost is
one more LM-head matmul per chunk in the backward.

    logits_c = lm_head(norm(h[a:b])) / T                      [c, V], c <= chunk
    logp     = logits_c[row, target] - logsumexp(logits_c)[row]
    entropy  = logsumexp(logits_c) - sum_v softmax(logits_c)_v * logits_c_v

``chunk=0`` computes every position's logits at once (the plain computation, whose memory grows
with positions x vocabulary).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from arborl.models.forward import lm_logits


def _chunk_scores(
    model: nn.Module, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` at the logit rows ``rows`` of the positions ``hidden``, and the entropy
    of every position (empty without ``with_entropy``)."""
    logits = lm_logits(model, hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits[rows, targets] - lse[rows]
    if not with_entropy:
        return logp, lse[:0]
    return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def head_logprobs(
    model: nn.Module,
    hidden: torch.Tensor,
    pair_row: torch.Tensor,
    pair_target: torch.Tensor,
    *,
    chunk: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-pair log-probs (and entropies) of next tokens from ``hidden`` [P, H], the decoder's hidden
    states before the final norm at the P positions whose next-token distribution is needed.

    Pair ``k`` is the prediction of token ``pair_target[k]`` at position ``pair_row[k]`` (a position
    may serve several pairs: tree packing's shared tokens). Returns (logp [K], entropy [K] or None),
    float32 at least, differentiable. ``chunk``: positions per chunk (0 = all at once)."""
    positions = hidden.shape[0]
    size = positions if chunk <= 0 else min(chunk, positions)
    if size >= positions and not (chunk > 0 and torch.is_grad_enabled()):
        logp, ent = _chunk_scores(model, hidden, pair_row, pair_target, temperature, with_entropy)
        return logp, (ent[pair_row] if with_entropy else None)
    # pairs grouped by chunk: sorted by row, each chunk's pairs one contiguous slice
    order = torch.argsort(pair_row, stable=True)
    rows_sorted = pair_row[order]
    bounds = torch.arange(0, positions + size, size, device=pair_row.device).clamp_(max=positions)
    cuts = torch.searchsorted(rows_sorted, bounds).tolist()
    grad = torch.is_grad_enabled()
    logps, ents = [], []
    for c in range(len(cuts) - 1):
        a, b = int(bounds[c]), int(bounds[c + 1])
        if a == b:
            continue
        sel = order[cuts[c] : cuts[c + 1]]
        args = (model, hidden[a:b], rows_sorted[cuts[c] : cuts[c + 1]] - a, pair_target[sel], temperature, with_entropy)
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_scores, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_scores(*args)
        logps.append(lp)
        ents.append(ent)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    logp = torch.cat(logps)[inverse]
    return logp, (torch.cat(ents)[pair_row] if with_entropy else None)
