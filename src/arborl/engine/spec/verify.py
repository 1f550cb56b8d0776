"""Acceptance of a verified draft tree, lossless.

The verify forward gives the policy's logits after the root (the sequence's last token) and after
every draft node. Walking down from the root, the children of the current node are tried in draft
order with speculative rejection sampling against the policy's sampling distribution p (temperature,
top-k, top-p): child token d (proposed deterministically, q = one-hot) is accepted with probability
min(1, p(d) / q(d)) = p(d); on rejection p becomes normalise(max(0, p - q)), i.e. p without d, and the
next child is tried. When no child is accepted (or the node is a leaf) one token is drawn from what
is left of p and the walk ends. Every emitted token therefore follows p exactly, as if sampled
without drafts; greedy requests take the argmax, which accepts a child iff it equals it. The raw and
sampling log-probs recorded are the policy's, computed as ``sampling.sample`` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborl.engine.sampling import _truncate, log_probs
from arborl.engine.spec.draft import Draft
from arborl.types import SamplingParams


@dataclass
class Accepted:
    tokens: list[int]  # accepted draft tokens then the one the policy added (>= 1 token)
    logprobs: list[float]
    sample_logprobs: list[float]
    nodes: list[int]  # draft node index of each accepted draft token (len(tokens) - 1 of them)


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p of the sampling distribution for rows of one request's logits [n, vocab] (as sample())."""
    scaled = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1:
        n = scaled.shape[0]
        top_k = torch.full((n,), params.top_k, device=logits.device)
        top_p = torch.full((n,), params.top_p, device=logits.device)
        scaled = _truncate(scaled, top_k, top_p)
    return log_probs(scaled)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    # Gumbel-max as in sample(): argmax(log p - log E), E ~ Exp(1)
    e = torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=generator)
    return int(torch.argmax(torch.log(probs) - torch.log(e)))


def accept(logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator) -> Accepted:
    """Walk ``draft`` (node i's logits are row i + 1 of ``logits`` [1 + len(draft), vocab]; row 0 is
    the root's) and return the tokens it accepts plus the policy's next token."""
    logits = logits.float()
    raw = log_probs(logits)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        children.setdefault(p + 1, []).append(i + 1)  # rows: root 0, node i -> i + 1
    out = Accepted([], [], [], [])
    greedy = params.greedy
    argmax = torch.argmax(logits, dim=-1).tolist() if greedy else None
    dist = None if greedy else sampling_logprobs(logits, params)
    row = 0
    while True:
        kids = children.get(row, [])
        nxt = -1
        if greedy:
            tok = argmax[row]
            nxt = next((c for c in kids if draft.tokens[c - 1] == tok), -1)
            slp = 0.0
        else:
            p = dist[row].exp()
            for c in kids:
                d = draft.tokens[c - 1]
                u = float(torch.rand((), device=p.device, generator=generator))
                if u < float(p[d]) / float(p.sum()):
                    nxt = c
                    break
                p = p.clone()
                p[d] = 0.0  # max(0, p - onehot(d)); the remaining mass is renormalised by the next test
            tok = draft.tokens[nxt - 1] if nxt >= 0 else _draw(p / p.sum(), generator)
            slp = float(dist[row, tok])
        out.tokens.append(tok)
        out.logprobs.append(float(raw[row, tok]))
        out.sample_logprobs.append(slp)
        if nxt < 0:
            return out
        out.nodes.append(nxt - 1)
        row = nxt
