"""One request that fails inside an engine step fails alone: the other requests of the step go on and
finish as if it had never been there. The poison is real data, not a mock: a token whose embedding row
is NaN (what a diverged checkpoint or a corrupt weight gives), so every forward over it yields NaN
logits for that sequence; and a sampling temperature so small that logits / T overflow."""

from __future__ import annotations

import asyncio

import pytest
import torch

from arborl.config import EngineConfig
from arborl.engine import AsyncEngine, LLMEngine, RequestFailedError
from arborl.engine.sampling import sample
from arborl.models import tiny_llama
from arborl.types import GenerateRequest, SamplingParams

VOCAB = 512
POISON = 7  # the token whose embedding is NaN


def _model():
    model = tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    return model


def _poisoned(model):
    with torch.no_grad():
        model.get_input_embeddings().weight[POISON] = float("nan")
    return model


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [[t if t != POISON else POISON + 1 for t in torch.randint(0, VOCAB - 1, (12 + i,), generator=g).tolist()]
            for i in range(n)]


def _requests(prompts, poisoned_at: int, params: SamplingParams) -> list[GenerateRequest]:
    out = []
    for i, p in enumerate(prompts):
        out.append(GenerateRequest(p[:5] + [POISON] + p[5:] if i == poisoned_at else p, params, request_id=f"r{i}"))
    return out


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_poisoned_request_among_eight_fails_alone_and_seven_finish_unchanged(spec, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True, seed=3)
    prompts = _prompts(8)
    cfg = EngineConfig(max_seq_len=128, max_batch_size=8, spec={"enabled": spec})
    clean = LLMEngine(_model(), cfg, eos_token_ids=[VOCAB - 1])
    expected = {r.request_id: r.token_ids for r in clean.generate(_requests(prompts, -1, params))}

    engine = LLMEngine(_poisoned(_model()), cfg, eos_token_ids=[VOCAB - 1])
    for r in _requests(prompts, 3, params):
        engine.add_request(r)
    results = engine.run_until_done()
    failed = engine.take_failed()
    assert [rid for rid, _ in failed] == ["r3"]
    assert "not finite" in failed[0][1]
    assert sorted(r.request_id for r in results) == [f"r{i}" for i in range(8) if i != 3]
    for r in results:  # the same tokens as without the poisoned neighbour: nothing leaked across sequences
        assert r.token_ids == expected[r.request_id], r.request_id
    assert not engine.has_work
    # the engine keeps serving, and the poisoned prompt's KV did not reach a later request's prefix
    again = engine.generate(_requests(prompts[:2], -1, params))
    assert [r.token_ids for r in again] == [expected["r0"], expected["r1"]]


def test_the_async_engine_fails_the_poisoned_call_alone():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = _prompts(8)
    engine = AsyncEngine(LLMEngine(_poisoned(_model()), EngineConfig(max_seq_len=128, max_batch_size=8),
                                   eos_token_ids=[VOCAB - 1]))

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in _requests(prompts, 5, params)),
                                    return_exceptions=True)

    try:
        out = asyncio.run(run())
    finally:
        engine.shutdown()
    assert isinstance(out[5], RequestFailedError) and "r5" in str(out[5])
    assert all(len(r.token_ids) == 6 for i, r in enumerate(out) if i != 5)


def test_rows_that_are_not_distributions_are_reported_and_still_get_an_id_in_the_vocabulary():
    logits = torch.randn(4, 50)
    logits[1] = float("nan")
    logits[2, 7] = float("inf")
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=2**62)]  # top_k past the vocabulary: all of it
    out = sample(logits, params, [1, 2, 3, 4], [0, 0, 0, 0])
    assert out.failed == [1, 2]
    assert all(0 <= t < 50 for t in out.tokens)
    assert out.tokens[3] == sample(logits[3:], [SamplingParams(temperature=0.7)], [4], [0]).tokens[0]


def test_a_temperature_too_small_for_float32_is_greedy():
    logits = torch.randn(3, 50) * 30
    tiny = sample(logits, [SamplingParams(temperature=1e-45)] * 3, [1, 2, 3], [0, 0, 0])
    assert tiny.failed == [] and tiny.tokens == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy
