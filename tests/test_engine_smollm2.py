"""The engine on the real default model: greedy tokens and log-probs equal a plain transformers
forward (float32, <= 1e-4), also after a prefix-cache hit and across a weight update."""

from __future__ import annotations

import copy

import pytest
import torch

from arborl.config import EngineConfig, ModelConfig
from arborl.engine import LLMEngine
from arborl.models import chat_token_ids, load_model
from arborl.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model(ModelConfig(source="smollm2"))


@torch.no_grad()
def ref_logprobs(model, prompt, output):
    logp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[pos, torch.tensor(output)], logp[pos].argmax(-1)


def check(model, res):
    ref, argmax = ref_logprobs(model, res.prompt_token_ids, res.token_ids)
    assert (torch.tensor(res.logprobs) - ref).abs().max().item() <= 1e-4
    assert res.token_ids == argmax.tolist()


def test_smollm2_engine_matches_transformers(smollm2):
    model = smollm2.model
    eng = LLMEngine(model, EngineConfig(max_seq_len=512, max_batch_size=4), eos_token_ids=smollm2.eos_token_ids,
                    tokenizer=smollm2.tokenizer)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    msgs = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Name a colour.")]
    prompts = [chat_token_ids(smollm2.tokenizer, m) for m in msgs]
    first = eng.generate([GenerateRequest(p, greedy) for p in prompts])
    for r in first:
        check(model, r)
    # a follow-up turn: the whole first exchange comes from the prefix cache
    follow = first[0].prompt_token_ids + first[0].token_ids + smollm2.tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    hit = eng.generate([GenerateRequest(follow, greedy)])[0]
    assert hit.cached_prompt_tokens >= len(first[0].prompt_token_ids) + len(first[0].token_ids) - 1
    check(model, hit)
    # across a weight update: tokens before from v0, after from v1, each matching its policy
    old = copy.deepcopy(model)  # the engine updates `model` in place
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.model.layers[-1].mlp.parameters():
            p.add_(0.05 * torch.randn_like(p))
    req = GenerateRequest(prompts[1], greedy)
    eng.add_request(req)
    for _ in range(4):
        eng.step()
    eng.update_weights(new.state_dict(), 1)
    res = eng.run_until_done()[0]
    k = res.versions.index(1)
    assert 0 < k < len(res.versions) and set(res.versions[k:]) == {1}
    old_ref, _ = ref_logprobs(old, res.prompt_token_ids, res.token_ids[:k])
    new_ref, _ = ref_logprobs(new, res.prompt_token_ids + res.token_ids[:k], res.token_ids[k:])
    got = torch.tensor(res.logprobs)
    assert (got[:k] - old_ref).abs().max().item() <= 1e-4
    assert (got[k:] - new_ref).abs().max().item() <= 1e-4
