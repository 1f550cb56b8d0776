"""Calibrate the simulator's cost model against the built-in engine: measure decode step times at a
few batch sizes and contexts and prefill times at a few prompt lengths, then least-squares fit the
lines of ``arborl.sim.cost`` (the fit and every point are returned so a bench can show them).

Each point is the fastest of several repetitions: on a shared machine other processes only ever
add time, so the minimum is the most repeatable estimate of what the engine itself costs."""

from __future__ import annotations

import time

import torch
from torch import nn

from arborl.config import EngineConfig
from arborl.engine import LLMEngine
from arborl.sim.cost import Fit, fit_decode, fit_prefill
from arborl.types import GenerateRequest, SamplingParams


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (n, length), generator=g).tolist()


def measure_decode(model: nn.Module, vocab: int, *, batch: int, context: int, steps: int = 6, seed: int = 0) -> float:
    """Seconds of one decode step of ``batch`` sequences with ``context`` tokens each (fastest step)."""
    eng = LLMEngine(model, EngineConfig(max_batch_size=batch, max_seq_len=context + steps + 8, prefix_cache=False),
                    eos_token_ids=[])
    params = SamplingParams(temperature=1.0, max_tokens=steps + 2, ignore_eos=True, seed=seed)
    for p in _prompts(vocab, batch, context, seed):
        eng.add_request(GenerateRequest(p, params))
    eng.step()  # admission: prefill + first decode
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    eng.run_until_done()
    return min(times)


def measure_prefill(model: nn.Module, vocab: int, *, tokens: int, reps: int = 3, seed: int = 0) -> float:
    """Seconds to prefill one prompt of ``tokens`` tokens and sample its first token (fastest of ``reps``)."""
    eng = LLMEngine(model, EngineConfig(max_batch_size=1, max_seq_len=tokens + 8, prefix_cache=False,
                                        prefill_chunk_tokens=max(16, tokens)), eos_token_ids=[])
    times = []
    for i, p in enumerate(_prompts(vocab, reps, tokens, seed + 1)):
        eng.add_request(GenerateRequest(p, SamplingParams(max_tokens=1, ignore_eos=True, seed=i)))
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return min(times)


def calibrate(model: nn.Module, vocab: int, *, batches=(1, 4, 8, 16), contexts=(32, 256),
              prefill_tokens=(32, 128, 512), steps: int = 6) -> tuple[Fit, Fit]:
    """Measure the engine and fit decode and prefill; the decode context is the batch's summed KV."""
    decode = []
    measure_decode(model, vocab, batch=1, context=16, steps=2)  # warm-up
    for b in batches:
        for c in contexts:
            s = measure_decode(model, vocab, batch=b, context=c, steps=steps)
            decode.append((b, b * (c + steps // 2), s))
    prefill = [(n, measure_prefill(model, vocab, tokens=n)) for n in prefill_tokens]
    return fit_decode(decode), fit_prefill(prefill)
