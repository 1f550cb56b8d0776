"""Engine performance work (issue 20): prepacked CPU weights (engine.cpu_packed_weights) keep the
engine's numbers, follow weight updates, and are what the engine serves from; the bench's engine
worker (the vLLM column's protocol) round-trips on a tiny model without vLLM."""

from __future__ import annotations

import pytest
import torch

from arborl.bench.vllm_column import EngineWorker, WorkerError
from arborl.config import EngineConfig
from arborl.engine import LLMEngine
from arborl.models import LoadedModel, tiny_llama
from arborl.types import GenerateRequest, SamplingParams

VOCAB = 512
EOS = VOCAB - 1


def _model(seed: int = 0):
    return tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=seed)


def _engine(model, packed: bool) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_seq_len=128, max_batch_size=4, cpu_packed_weights=packed),
                     eos_token_ids=[EOS])


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 9, 13)]


def _run(eng: LLMEngine, max_tokens: int = 8):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return eng.generate([GenerateRequest(p, params) for p in _prompts()])


@torch.no_grad()
def _reference(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    logp = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0].float(), -1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(out) - 1), torch.tensor(out)]


def test_packed_weights_match_a_transformers_forward_and_are_what_is_served():
    model = _model()
    eng = _engine(model, packed=True)
    assert eng.runner.linear is not None and len(eng.runner.linear) == 2 * 4 + 1  # per layer: q|k|v fused, o, gate|up fused, down; lm_head
    for r in _run(eng):
        assert torch.allclose(torch.tensor(r.logprobs), _reference(model, r.prompt_token_ids, r.token_ids), atol=1e-4)
    # served from the packed copy: changing the module's weight behind the engine's back changes nothing ...
    before = [r.token_ids for r in _run(eng)]
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    assert [r.token_ids for r in _run(eng)] == before
    # ... while the unpacked engine serves the module as it is now
    assert [r.token_ids for r in _run(_engine(model, packed=False))] != before


def test_packed_weights_follow_update_weights():
    eng = _engine(_model(seed=0), packed=True)
    new = _model(seed=3)
    eng.update_weights({k: v.clone() for k, v in new.state_dict().items()}, version=1)
    for r in _run(eng):
        assert r.versions == [1] * len(r.token_ids)
        assert torch.allclose(torch.tensor(r.logprobs), _reference(new, r.prompt_token_ids, r.token_ids), atol=1e-4)


def test_engine_worker_protocol_round_trips_on_a_tiny_model(tmp_path):
    model = _model()
    loaded = LoadedModel(model=model, tokenizer=None, name="tiny", eos_token_ids=[EOS], vocab_size=VOCAB,
                         max_position_embeddings=128)
    worker = EngineWorker(loaded, backend="transformers")
    try:
        assert worker.startup_s > 0
        prompts = _prompts()
        secs, toks = worker.generate(prompts, 6, True)
        assert secs > 0 and [len(t) for t in toks] == [6, 6, 6]
        assert toks == [r.token_ids for r in _run(_engine(model, packed=True), 6)]  # greedy agrees with arborl
        follow = [[[7, 8]] * 3, [[9]] * 3]
        mt = worker.multiturn(prompts, follow, 4)
        assert len(mt["token_ids"]) == 3 and all(len(t) == 4 for t in mt["token_ids"])
        # three turns' prompts: the first, + 4 generated + 2 follow-up, + 4 + 1
        first = sum(map(len, prompts))
        assert mt["prompt_tokens"] == first + (first + 3 * 6) + (first + 3 * 6 + 3 * 5)
        with pytest.raises(WorkerError, match="unknown op"):
            worker.call({"op": "nope"})
    finally:
        worker.close()
    assert worker.proc.poll() is not None
