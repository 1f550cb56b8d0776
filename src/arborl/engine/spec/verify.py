"""Acceptance of a verified draft tree, lossless.

The verify forward gives the policy's logits after the root (the sequence's last token) and after
every draft node. Walking down from the root, each position's token is drawn from the policy's
sampling distribution p (temperature, top-k, top-p) exactly as plain decoding draws it there
(``sampling.draw`` with the request's uniform for that position; greedy: the argmax), and the child
holding that token, if any, is accepted and the walk goes on from it; otherwise the drawn token is the
last one emitted. Every token therefore follows p exactly, and is the very token plain decoding with
the same seed emits. A child d is accepted with probability p(d), several children with the sum of
theirs: what speculative rejection sampling with deterministic drafts (q one-hot) accepts. The raw
and sampling log-probs recorded are the policy's, computed as ``sampling.sample`` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborl.engine.sampling import _truncate, draw, log_probs, position_uniform
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


def accept(logits: torch.Tensor, draft: Draft, params: SamplingParams, seed: int, position: int) -> Accepted:
    """Walk ``draft`` (node i's logits are row i + 1 of ``logits`` [1 + len(draft), vocab]; row 0 is
    the root's, whose token goes to ``position``) and return the tokens it accepts plus the policy's
    next token, for a request seeded ``seed``."""
    logits = logits.float()
    raw = log_probs(logits)
    children: dict[int, list[int]] = {}
    depth = [0] * (1 + len(draft))
    for i, p in enumerate(draft.parents):
        children.setdefault(p + 1, []).append(i + 1)  # rows: root 0, node i -> i + 1
        depth[i + 1] = depth[p + 1] + 1
    if params.greedy:
        chosen = torch.argmax(logits, dim=-1).tolist()
        dist = None
    else:  # every row's draw at once (a row's token depends on its own distribution and position only)
        dist = sampling_logprobs(logits, params)
        chosen = draw(dist, [position_uniform(seed, position + d) for d in depth]).tolist()
    out = Accepted([], [], [], [])
    row = 0
    while True:
        tok = chosen[row]
        nxt = next((c for c in children.get(row, []) if draft.tokens[c - 1] == tok), -1)
        out.tokens.append(tok)
        out.logprobs.append(float(raw[row, tok]))
        out.sample_logprobs.append(0.0 if dist is None else float(dist[row, tok]))
        if nxt < 0:
            return out
        out.nodes.append(nxt - 1)
        row = nxt
