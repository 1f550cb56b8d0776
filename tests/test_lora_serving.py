"""The engine serves a LoRA policy as its base weights plus the adapters (``train.lora_sync=adapters``):
the same tokens and log-probs as the merged policy, the same weights bit for bit once merged, no
repacking of the base for an adapters-only update, and the controller publishing the base once."""

from __future__ import annotations

import copy

import pytest
import torch

from arborl.config import EngineConfig, TrainConfig
from arborl.engine.engine import LLMEngine
from arborl.models import tiny_llama
from arborl.models.lora import Adapter, adapter_entries, merge, split_adapters
from arborl.types import ArborlError, GenerateRequest, SamplingParams

TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj")


def base_model(seed: int = 3):
    return tiny_llama(layers=2, hidden=64, vocab=96, heads=4, kv_heads=2, seed=seed)


def random_adapters(model, rank: int = 4, seed: int = 0, scale: float = 2.0) -> dict[str, Adapter]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(len(model.model.layers)):
        for t in TARGETS:
            name = f"model.layers.{i}.{t}"
            m = model.get_submodule(name)
            out[name] = Adapter(torch.randn(rank, m.in_features, generator=g) * 0.2,
                                torch.randn(m.out_features, rank, generator=g) * 0.2, scale)
    return out


def published(adapters: dict[str, Adapter]) -> dict[str, torch.Tensor]:
    return {k: v for name, ad in adapters.items() for k, v in adapter_entries(name, ad).items()}


def merged_state(model, adapters: dict[str, Adapter]) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, ad in adapters.items():
        state[f"{name}.weight"] = merge(state[f"{name}.weight"], ad)
    return state


def requests(temperature: float) -> list[GenerateRequest]:
    return [GenerateRequest([1 + i, 7, 9, 3, 4 + i], SamplingParams(temperature=temperature, max_tokens=12, seed=i,
                                                                  ignore_eos=True)) for i in range(4)]


@pytest.mark.parametrize("packed,owns", [(True, True), (True, False), (False, False)])
def test_an_engine_serving_base_plus_adapters_matches_the_merged_policy(packed, owns):
    """Packed (the adapters ride in the packs, fused q|k|v side by side) or not (forward hooks): greedy
    and seeded sampling give the merged policy's tokens, log-probs within float32 rounding."""
    base = base_model()
    adapters = random_adapters(base)
    cfg = EngineConfig(max_seq_len=128, max_batch_size=4, cpu_packed_weights=packed)
    merged = LLMEngine(copy.deepcopy(base), cfg, eos_token_ids=[])
    served = LLMEngine(copy.deepcopy(base), cfg, eos_token_ids=[], owns_model=owns)
    plain = LLMEngine(copy.deepcopy(base), cfg, eos_token_ids=[])
    merged.update_weights(merged_state(base, adapters), 1)
    served.update_weights(published(adapters), 1)
    for temperature in (0.0, 1.0):
        want, got, before = (e.generate(requests(temperature)) for e in (merged, served, plain))
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for a, b in zip(got, want):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert [r.token_ids for r in before] != [r.token_ids for r in want]  # the adapters change the policy
    # a state without adapter entries is a whole policy: the adapters go
    served.update_weights(base.state_dict(), 2)
    again = served.generate(requests(0.0))
    assert [r.token_ids for r in again] == [r.token_ids for r in plain.generate(requests(0.0))]


def test_an_adapters_only_update_keeps_the_base_packs_and_a_partial_update_repacks_what_it_touches():
    base = base_model()
    eng = LLMEngine(copy.deepcopy(base), EngineConfig(max_seq_len=128, max_batch_size=4), eos_token_ids=[],
                    owns_model=True)
    if eng.runner.linear is None:
        pytest.skip("no packed weights on this machine")

    def packs() -> dict:
        return {mods: (p.onednn, p.panels) for mods, p in eng.runner.linear.packed_groups().items()}

    start = packs()
    eng.update_weights(published(random_adapters(base, seed=1)), 1)
    eng.update_weights(published(random_adapters(base, seed=2)), 2)
    after = packs()
    assert after.keys() == start.keys()
    assert all(after[k][0] is start[k][0] and after[k][1] is start[k][1] for k in start)  # not one repacked
    layer = eng.model.model.layers[1]
    eng.update_weights({"model.layers.1.mlp.down_proj.weight": torch.zeros_like(base.model.layers[1].mlp.down_proj.weight)}, 3)
    now = packs()
    touched = [k for k in start if now[k][0] is not start[k][0] or now[k][1] is not start[k][1]]
    assert touched == [(layer.mlp.down_proj,)]


def test_the_trainers_adapters_merge_to_its_published_weights_bit_for_bit():
    """What an adapters-only sync gives an engine, merged with ``models.lora.merge``, is the full sync's
    weights bit for bit; and an engine fed base + adapters samples what one fed the merged weights does."""
    pytest.importorskip("peft")
    from arborl.train.trainer import Trainer
    from test_trainer import VOCAB, make_samples

    t = Trainer(tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=0),
                TrainConfig(lr=5e-2, lora_rank=4, lora_targets=["q_proj", "v_proj", "down_proj"]))
    for i in range(2):
        t.train_step(make_samples(30 + i))
    full = t.engine_state()
    base, adapter_state = t.base_state(), t.adapter_state()
    assert adapter_state and all(k.endswith(("lora_A", "lora_B", "lora_scale")) for k in adapter_state)
    assert sum(v.nbytes for v in adapter_state.values()) < 0.25 * sum(v.nbytes for v in full.values())
    rest, adapters = split_adapters({**base, **adapter_state})
    assert rest.keys() == full.keys()
    assert len(adapters) == 2 * 3
    for k, v in rest.items():
        name = k.removesuffix(".weight")
        want = merge(v, adapters[name]) if name in adapters else v
        assert torch.equal(want, full[k]), k
    assert t.adapter_state()["model.layers.0.self_attn.q_proj.lora_B"].data_ptr() != \
        adapter_state["model.layers.0.self_attn.q_proj.lora_B"].data_ptr()  # copies: training may go on

    plain = tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    cfg = EngineConfig(max_seq_len=128, max_batch_size=4)
    by_merge = LLMEngine(copy.deepcopy(plain), cfg, eos_token_ids=[])
    by_adapters = LLMEngine(copy.deepcopy(plain), cfg, eos_token_ids=[], owns_model=True)
    by_merge.update_weights(full, 1)
    by_adapters.update_weights({**base, **adapter_state}, 1)
    reqs = [GenerateRequest([1 + i, 5, 9], SamplingParams(temperature=1.0, max_tokens=10, seed=i, ignore_eos=True))
            for i in range(3)]
    a, b = by_merge.generate(reqs), by_adapters.generate(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_bad_adapters_are_refused_with_what_to_fix():
    base = base_model()
    eng = LLMEngine(copy.deepcopy(base), EngineConfig(max_seq_len=64, max_batch_size=2), eos_token_ids=[])
    ad = random_adapters(base)["model.layers.0.self_attn.q_proj"]
    with pytest.raises(ArborlError, match="lacks lora_scale"):
        eng.update_weights({"model.layers.0.self_attn.q_proj.lora_A": ad.a,
                            "model.layers.0.self_attn.q_proj.lora_B": ad.b}, 1)
    with pytest.raises(ArborlError, match="not a Linear module"):
        eng.update_weights(adapter_entries("model.layers.0.self_attn.nope", ad), 1)
    with pytest.raises(ArborlError, match="maps 64 -> 64, the module 64 -> 256"):
        eng.update_weights(adapter_entries("model.layers.0.mlp.gate_proj", ad), 1)
    with pytest.raises(ArborlError, match=r"\[rank, in\]"):
        eng.update_weights(adapter_entries("model.layers.0.self_attn.q_proj", Adapter(ad.a, ad.b.T, 1.0)), 1)
    assert eng.version == 0


@pytest.mark.parametrize("sync", ["adapters", "merged"])
def test_a_lora_run_publishes_the_base_once_then_the_adapters_alone(tmp_path, sync):
    """train.lora_sync=adapters: the first publish carries this trainer's base with its adapters, every later
    one the adapters alone (a few KB here); merged: the whole policy every step."""
    pytest.importorskip("peft")
    import json

    from arborl.run.job import train
    from helpers.tiny_run import tiny_cfg

    cfg = tiny_cfg(tmp_path, f"lora-{sync}", "train.lora_rank=4", f"train.lora_sync={sync}", "rollout.steps=3")
    train(cfg)
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    mb = [r["publish_mb"] for r in rows if r.get("kind") == "step"]
    model_mb = sum(v.nbytes for v in load_model_state(cfg).values()) / 1e6
    assert len(mb) == 3
    if sync == "merged":
        assert all(abs(x - model_mb) < 1e-6 for x in mb)
    else:
        assert mb[0] > 0.9 * model_mb and all(0 < x < 0.05 * model_mb for x in mb[1:]), (mb, model_mb)


def load_model_state(cfg) -> dict[str, torch.Tensor]:
    from arborl.models.loading import load_model

    return load_model(cfg.model).model.state_dict()


def test_a_fan_in_fan_out_adapter_is_merged_as_peft_merges_it_and_never_published_alone():
    """GPT-2's Conv1D stores its weight transposed: the trainer's merge equals peft's own merged weight, and
    adapter_state is None, so the controller publishes merged weights (the engines serve Linear adapters only)."""
    pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    from arborl.train.trainer import Trainer

    torch.manual_seed(0)
    t = Trainer(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)),
                TrainConfig(lora_rank=4, lora_targets=["c_attn"]))
    layer = t.policy.transformer.h[0].attn.c_attn
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()  # peft starts B at zero: give the adapter a delta
    assert t.adapter_state() is None
    state = t.engine_state()
    want = (layer.base_layer.weight + layer.get_delta_weight("default")).detach()
    assert torch.allclose(state["transformer.h.0.attn.c_attn.weight"], want, atol=1e-6)
    assert not torch.allclose(want, layer.base_layer.weight)
