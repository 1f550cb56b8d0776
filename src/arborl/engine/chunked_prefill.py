"""Chunked prefill: sequences' new tokens run through the runner's packed prefill forward, several
sequences per forward and long ones split, so that no forward holds more than ``budget`` tokens
(``engine.prefill_chunk_tokens``). Admission prefills a wave's prompts this way, and a weight update
recomputes the running sequences' KV this way."""

from __future__ import annotations

import torch

from arborl.engine.model_runner import ModelRunner
from arborl.engine.sequence import Sequence
from arborl.engine.stats import EngineStats


def prefill_chunked(runner: ModelRunner, jobs: list[tuple[Sequence, list[int], int]], budget: int,
                    stats: EngineStats) -> torch.Tensor:
    """Run each job's tokens into its sequence's slot from position ``start``; each sequence's
    ``kv_len`` becomes ``start + len(tokens)``. Returns the logits after each job's last token, in job
    order."""
    out: list[torch.Tensor | None] = [None] * len(jobs)
    pending = [(i, seq, toks, start) for i, (seq, toks, start) in enumerate(jobs)]
    while pending:
        items, rows, rest, used = [], [], [], 0
        for i, seq, toks, start in pending:
            take = min(len(toks), budget - used)
            if take <= 0:
                rest.append((i, seq, toks, start))
                continue
            items.append((seq.slot, toks[:take], start))
            rows.append(i if take == len(toks) else -1)
            if take < len(toks):
                rest.append((i, seq, toks[take:], start + take))
            used += take
        logits = runner.prefill(items)
        for row, i in enumerate(rows):
            if i >= 0:
                out[i] = logits[row]
        pending = rest
    for seq, toks, start in jobs:
        seq.kv_len = start + len(toks)
        stats.prefill_tokens += len(toks)
    return torch.stack(out)  # type: ignore[arg-type]
