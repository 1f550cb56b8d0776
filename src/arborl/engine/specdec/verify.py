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

from arborl.engine.sampling import sample, sampling_log_probs
from arborl.engine.specdec.draft import Draft
from arborl.types import SamplingParams


@dataclass
class Accepted:
    tokens: list[int]  # accepted draft tokens then the one the policy added (>= 1 token)
    logprobs: list[float]
    sample_logprobs: list[float]
    nodes: list[int]  # draft node index of each accepted draft token (len(tokens) - 1 of them)


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p of the sampling distribution for rows of one request's logits [n, vocab] (as sample())."""
    return sampling_log_probs(logits.float(), [params] * logits.shape[0])


def accept_all(logits: torch.Tensor, drafts: list[Draft], params: list[SamplingParams], seeds: list[int],
               positions: list[int]) -> list[Accepted]:
    """Walk every sequence's draft at once: sequence r's root row is ``logits[r, 0]`` (its token goes to
    ``positions[r]``) and node i's row ``logits[r, i + 1]``. Every row's token is drawn in one batched
    ``sample`` (the rows of one step, as plain decoding samples a batch), then each walk is a lookup."""
    at_r, at_c, row_params, row_seeds, row_pos, starts = [], [], [], [], [], []
    for r, d in enumerate(drafts):
        depth = [0] * (1 + len(d))
        for i, p in enumerate(d.parents):
            depth[i + 1] = depth[p + 1] + 1
        starts.append(len(at_r))
        at_r += [r] * len(depth)
        at_c += range(len(depth))
        row_params += [params[r]] * len(depth)
        row_seeds += [seeds[r]] * len(depth)
        row_pos += [positions[r] + x for x in depth]
    rows = logits[torch.tensor(at_r, device=logits.device), torch.tensor(at_c, device=logits.device)]
    drawn = sample(rows, row_params, row_seeds, row_pos)
    out = []
    for d, base in zip(drafts, starts):
        children: dict[int, list[int]] = {}
        for i, p in enumerate(d.parents):
            children.setdefault(p + 1, []).append(i + 1)  # rows: root 0, node i -> i + 1
        acc = Accepted([], [], [], [])
        row = 0
        while True:
            tok = drawn.tokens[base + row]
            nxt = next((c for c in children.get(row, []) if d.tokens[c - 1] == tok), -1)
            acc.tokens.append(tok)
            acc.logprobs.append(drawn.logprobs[base + row])
            acc.sample_logprobs.append(drawn.sample_logprobs[base + row])
            if nxt < 0:
                break
            acc.nodes.append(nxt - 1)
            row = nxt
        out.append(acc)
    return out

