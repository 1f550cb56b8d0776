"""Engine performance work (issue 20): prepacked CPU weights (engine.cpu_packed_weights) keep the
engine's numbers, follow weight updates, and are what the engine serves from; the bench's engine
worker (the vLLM column's protocol) round-trips on a tiny model without vLLM."""

from __future__ import annotations

import pytest
import torch

from arborl_bench.vllm_column import EngineWorker, WorkerError
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
        state = lambda: open(f"/proc/{worker.proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: E731
        with worker.stopped():  # while arborl's engine is measured, the worker takes no CPU
            assert state() == "T"
        assert worker.generate(prompts, 2, True)[1] == [t[:2] for t in toks]  # and answers after
    finally:
        worker.close()
    assert worker.proc.poll() is not None


def _qwen(arch: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = model_cls(cfg).eval()
    if arch == "qwen2":  # q/k/v carry biases: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_packed_forward_computes_what_the_shared_forward_computes(arch):
    """The lean forward over packed weights (prefill, decode, verify) gives the logits of
    ``decoder_hidden`` over the same packed weights, and is what a packed engine runs."""
    model = _model() if arch == "llama" else _qwen(arch)
    eng = _engine(model, packed=True)
    runner = eng.runner
    assert runner.packed_forward is not None
    lean = runner.packed_forward
    prompts = _prompts()

    def forwards(use_lean: bool) -> list[torch.Tensor]:
        runner.packed_forward = lean if use_lean else None
        out = [runner.prefill([(i, p, 0) for i, p in enumerate(prompts)])]
        out.append(runner.decode([3, 4, 5], [len(p) for p in prompts]))
        out.append(runner.verify([(i, len(p) + 1, [7, 8, 9], [-1, 0, 0]) for i, p in enumerate(prompts)])[:, :3])
        return out

    for a, b in zip(forwards(False), forwards(True)):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    runner.packed_forward = lean
    for r in _run(eng):  # and the engine on it still serves the model's own log-probs
        assert torch.allclose(torch.tensor(r.logprobs), _reference(model, r.prompt_token_ids, r.token_ids), atol=1e-4)


def test_packed_forward_leaves_models_it_does_not_cover_to_the_shared_forward():
    model = _qwen("qwen3")  # per-head q/k norms
    eng = _engine(model, packed=True)
    assert eng.runner.linear is not None and eng.runner.packed_forward is None
    for r in _run(eng):
        assert torch.allclose(torch.tensor(r.logprobs), _reference(model, r.prompt_token_ids, r.token_ids), atol=1e-4)


def test_the_roofline_counts_the_bytes_and_multiply_adds_a_decode_step_streams():
    """``bench engine``'s roofline: the machine's measured limits, and per batch size the weight bytes
    a step reads (float32 panels; half of them for the bf16 rollout) and its fraction of the limit."""
    import copy

    from arborl_bench.engine_bench import decode_roofline, machine_limits
    from arborl.engine import cpu_kernels
    from arborl.models.quantize import cpu_has_bf16, to_serving_dtype

    limits = {"copy_gb_per_s": 10.0, "gemm_fp32_gflops": 100.0, "gemm_bf16_gflops": 200.0}
    model = tiny_llama(layers=2, hidden=64, vocab=512, heads=4, kv_heads=2, seed=0)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # 200 tokens of context: the KV read is then a large share of the limit, so a roofline that ignored it fails here
    fp32 = decode_roofline(model, limits, (1, 4), bf16=False, context=200, steps=2)
    for b, f in fp32.items():
        assert 0 < f["fraction_of_limit"] and f["step_ms"] > 0 and f["regime"] in ("bandwidth", "compute")
        assert f["weight_mb"] == round(4 * linear_params / 1e6, 1)  # 16-column panels: no padding at 64-wide
        mem_ms, gemm_ms = 4 * linear_params / 10e9 * 1e3, 2 * b * linear_params / 100e9 * 1e3
        assert f["limit_ms"] == round(max(mem_ms, gemm_ms), 2)
        # the attention's read: 2 layers x K and V x b rows x 2 kv heads x (200 + 1 + 2 // 2) keys x 16 dims x 4 bytes
        kv_bytes = 2 * 2 * b * 2 * 202 * 16 * 4
        assert f["kv_mb"] == round(kv_bytes / 1e6, 3)
        with_kv = f["fraction_of_limit"] * (max(mem_ms, gemm_ms) + kv_bytes / 10e9 * 1e3) / max(mem_ms, gemm_ms)
        assert with_kv > 1.1 * f["fraction_of_limit"]  # the read moves the figure by more than the rounding
        # both fractions are rounded to 3 decimals: within 0.002 of each other's relation
        assert f["fraction_of_limit_with_kv"] == pytest.approx(with_kv, abs=0.002)
    if cpu_has_bf16() and cpu_kernels.has_bf16():
        bf16 = decode_roofline(to_serving_dtype(copy.deepcopy(model), "bfloat16"), limits, (4,), bf16=True, context=8, steps=2)
        assert bf16[4]["weight_mb"] == round(2 * linear_params / 1e6, 1)
    measured = machine_limits()
    assert measured["copy_gb_per_s"] > 0 and measured["gemm_fp32_gflops"] > 0
    assert ("gemm_bf16_gflops" in measured) == cpu_has_bf16()
