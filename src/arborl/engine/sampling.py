"""Token sampling: temperature, top-k, top-p, greedy, per-request seeds.

For every sampled token we return two log-probabilities:
  * raw:     log softmax(logits)[token]              -- the temperature-1 policy the trainer recomputes;
  * sampled: log of the token's probability under the distribution it was drawn from
             (logits / T, then top-k / top-p truncation and renormalisation; 0.0 for greedy).
Each row draws from its own ``torch.Generator`` so a seeded request gives the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborl.types import SamplingParams


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    sample_logprobs: list[float]


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last dim as ``z - logsumexp(z)`` (the trainer's ``token_logprobs`` formula).
    At SmolLM2's logit scale (up to ~32) torch's CPU ``log_softmax`` in float32 is 2e-5 away from a
    float64 reference where this is 2e-6, so every log-prob the engine records goes through here."""
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf. top_k=0 and top_p=1 are no-ops."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it >= top_p
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)  # float cumsum may reach 1 early
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> SampleOutput:
    """Sample one token per row of ``logits`` [n, vocab] (float32 on any device)."""
    logits = logits.float()
    n = logits.shape[0]
    device = logits.device
    rows = torch.arange(n, device=device)
    tokens = torch.argmax(logits, dim=-1)
    sample_lp = torch.zeros(n, device=device)
    todo = [i for i, p in enumerate(params) if not p.greedy]
    if todo:
        idx = torch.tensor(todo, device=device)
        sub = [params[i] for i in todo]
        scaled = logits[idx] / torch.tensor([p.temperature for p in sub], device=device).unsqueeze(-1)
        top_k = torch.tensor([p.top_k for p in sub], device=device)
        top_p = torch.tensor([p.top_p for p in sub], device=device)
        if bool((top_k > 0).any() or (top_p < 1).any()):
            scaled = _truncate(scaled, top_k, top_p)
        dist = log_probs(scaled)
        # Gumbel-max with per-row generators: argmax(log p - log E), E ~ Exp(1), is a draw from p.
        for j, i in enumerate(todo):
            e = torch.empty(dist.shape[-1], device=device).exponential_(generator=generators[i])
            tokens[i] = torch.argmax(dist[j] - torch.log(e))
        sample_lp[idx] = dist[torch.arange(len(todo), device=device), tokens[idx]]
    return SampleOutput(
        tokens=tokens.tolist(),
        logprobs=(logits[rows, tokens] - torch.logsumexp(logits, dim=-1)).tolist(),  # = log_probs(logits)[rows, tokens]
        sample_logprobs=sample_lp.tolist(),
    )
