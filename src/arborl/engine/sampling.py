"""Token sampling: temperature, top-k, top-p, greedy, per-request seeds.

For every sampled token we return two log-probabilities:
  * ``logprobs`` (raw):  log softmax(logits)[token]  -- the temperature-1 policy the trainer recomputes;
  * ``sample_logprobs``: log of the token's probability under the distribution it was drawn from
                         (logits / T, then top-k / top-p truncation and renormalisation; 0.0 for greedy).

The token at position t of a request seeded s is the inverse-CDF draw of one uniform that is a hash
of (s, t) alone (``position_uniform``). So a seeded request gives the same tokens whatever else shares
its batch, and whether or not its tokens came through speculative decoding: the acceptance walk draws
each position's token with that position's uniform and accepts the draft token only if it is that
token (``spec/verify.py``), so speculation changes how fast a text comes out, never which text.
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
    failed: list[int]  # rows whose logits were not finite (NaN / inf): no token can be drawn from them


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


_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that draws the token at ``position`` (its index in prompt + output) of a
    request seeded ``seed``: splitmix64's finaliser over the pair, 53 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def draw(dist: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """One token per row of log-probabilities ``dist`` [n, vocab]: the first whose cumulative
    probability (float64) exceeds u * total, for that row's uniform u. Tokens of zero mass are never
    drawn. A row that is not a distribution (NaN) still gets an id inside the vocabulary; ``sample``
    reports it as failed."""
    cdf = torch.cumsum(dist.exp().double(), dim=-1)
    total = cdf[:, -1:].contiguous()
    u = torch.tensor(uniforms, dtype=torch.float64, device=dist.device).unsqueeze(-1)
    idx = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last token with mass (u * total may round up to total)
    return torch.minimum(idx, last).squeeze(-1).clamp_(max=dist.shape[-1] - 1)


def sampling_log_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """log p of the distribution each row is sampled from (``logits[i] / T``, then top-k / top-p
    truncation), for rows of float32 logits [n, vocab] with one non-greedy ``params`` per row."""
    device = logits.device
    scaled = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(-1)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k < vocab else 0 for p in params], device=device)  # >= vocab: all of it
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k > 0).any() or (top_p < 1).any()):
        scaled = _truncate(scaled, top_k, top_p)
    return log_probs(scaled)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> SampleOutput:
    """Sample one token per row of ``logits`` [n, vocab] (float32 on any device); row i's token is the
    one at ``positions[i]`` of a request seeded ``seeds[i]``."""
    logits = logits.float()
    n = logits.shape[0]
    device = logits.device
    rows = torch.arange(n, device=device)
    todo = [i for i, p in enumerate(params) if not p.greedy]
    # the argmax only where a row is greedy, the rows gathered only where some are: at 32 rows of
    # SmolLM2's 49152 logits each was ~1 ms of an ~11 ms sampled step
    tokens = torch.argmax(logits, dim=-1) if len(todo) < n else torch.empty(n, dtype=torch.long, device=device)
    sample_logprobs = torch.zeros(n, device=device)
    logprobs = None
    if todo:
        every = len(todo) == n
        idx = rows if every else torch.tensor(todo, device=device)
        dist = sampling_log_probs(logits if every else logits[idx], [params[i] for i in todo])
        tokens[idx] = draw(dist, [position_uniform(seeds[i], positions[i]) for i in todo])
        sample_logprobs[idx] = dist[torch.arange(len(todo), device=device), tokens[idx]]
        if every and all(p.temperature == 1.0 and p.top_k <= 0 and p.top_p >= 1.0 for p in params):
            logprobs = sample_logprobs  # logits / 1.0 is logits: dist is log_probs(logits), the same bits as below
    if logprobs is None:
        logprobs = logits[rows, tokens] - torch.logsumexp(logits, dim=-1)  # = log_probs(logits)[rows, tokens]
    bad = ~(torch.isfinite(logprobs) & torch.isfinite(sample_logprobs))
    failed = bad.nonzero().flatten().tolist() if bool(bad.any()) else []
    return SampleOutput(tokens=tokens.tolist(), logprobs=logprobs.tolist(), sample_logprobs=sample_logprobs.tolist(),
                        failed=failed)
