"""Low-precision rollout (I5): the engines' copy of the policy in bf16 / int8 / FP8 while the trainer keeps
fp32; weight updates are converted on arrival; the gap shows in the rollout log-probs. The FP8 GEMM runs
only on CUDA GPUs with FP8 (skipped here with the reason); its CPU reference is tested."""

from __future__ import annotations

import copy

import pytest
import torch

from arborl.models import quantize
import torch.nn.functional as F

from arborl.run.assemble import build_gateway
from arborl.config import Config, EngineConfig, ModelConfig, load_config
from arborl.engine import LLMEngine
from arborl.models import load_model
from arborl.models.quantize import (
    Bf16Linear,
    Fp8Linear,
    LowPrecisionError,
    cpu_has_bf16,
    fp8_available,
    fp8_linear_reference,
    fp8_weight,
    Int8Linear,
    int8_rows,
    int8_weight,
    is_low_precision,
    to_serving_dtype,
)
from arborl.types import ArborlError, GenerateRequest, SamplingParams

TINY = ModelConfig(source="tiny", tiny_hidden=64, tiny_vocab=512, tiny_layers=2, seed=1)


def tiny():
    return load_model(TINY).model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def rollout_logprobs(model, seed=0):
    eng = LLMEngine(model, EngineConfig(max_seq_len=128, max_batch_size=4), eos_token_ids=[])
    reqs = [GenerateRequest([1 + i, 7, 9, 3], SamplingParams(temperature=1.0, max_tokens=6, seed=seed + i, ignore_eos=True))
            for i in range(3)]
    return eng.generate(reqs)


def test_int8_weight_is_per_channel_symmetric_and_within_half_a_step():
    w = torch.randn(8, 16) * torch.arange(1, 9)[:, None]  # rows of very different scale
    q, scale = int8_weight(w)
    assert q.dtype == torch.int8 and torch.allclose(scale, w.abs().amax(dim=1) / 127, rtol=1e-6)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    assert (q.abs().amax(dim=1) == 127).all()  # every row's largest weight uses the full range


def test_int8_linear_is_the_exact_integer_product_of_per_row_quantised_inputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 24)
    mod = Int8Linear(lin)
    x = torch.randn(5, 48) * torch.arange(1, 6)[:, None]  # rows of very different scale
    x[3] = 0.0  # a zero row stays zero
    xq, sx = int8_rows(x)
    sums = (xq.long() @ mod.weight_q.long().T).float()  # exact
    want = sums * sx * mod.weight_scale + lin.bias.detach()
    assert torch.equal(mod(x), want)
    assert torch.equal(mod(x[3:4]), lin.bias.detach()[None])
    assert ((mod(x) - lin(x)).norm() / lin(x).norm()).item() < 0.02
    # each row alone as in the batch, and a leading shape kept
    assert all(torch.equal(mod(x[i : i + 1]), mod(x)[i : i + 1]) for i in range(5))
    assert mod(x.view(5, 1, 48)).shape == (5, 1, 24)


@pytest.mark.parametrize("dtype,bound", [("bfloat16", 0.05), ("int8", 0.08)])
def test_serving_copy_is_close_to_fp32_and_not_equal(dtype, bound):
    m = tiny()
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = logits(m, ids)
    served = to_serving_dtype(copy.deepcopy(m), dtype)
    got = logits(served, ids)
    # relative error of the logits (measured: bf16 ~0.015 for the whole model in bf16, ~0.002 for bf16
    # Linear weights on a CPU; int8 ~0.04 with a scale per activation row, 0.08-0.11 when one scale
    # covered the batch, on this random 64-wide model)
    gap = ((got - ref).norm() / ref.norm()).item()
    if dtype == "bfloat16" and not cpu_has_bf16():  # no bf16 dot products: float32 kept, and said so
        assert gap == 0 and not is_low_precision(served)
    else:
        assert 0 < gap < bound
        assert is_low_precision(served)
    # the trainer's model is untouched: fp32 parameters, plain Linear layers
    assert next(m.parameters()).dtype == torch.float32 and not is_low_precision(m)
    assert torch.equal(logits(m, ids), ref)
    assert to_serving_dtype(served, dtype) is served  # idempotent (engine replicas copy a converted model)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_weight_updates_are_converted_on_arrival(dtype):
    m = tiny()
    served = to_serving_dtype(copy.deepcopy(m), dtype)
    eng = LLMEngine(served, EngineConfig(max_seq_len=64), eos_token_ids=[])
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng.update_weights({k: v.clone() for k, v in m.state_dict().items()}, version=1)
    expect = to_serving_dtype(copy.deepcopy(m), dtype)  # a fresh conversion of the new fp32 weights
    ids = torch.randint(0, 512, (1, 10))
    assert torch.equal(logits(served, ids), logits(expect, ids))
    with pytest.raises(ArborlError, match="unknown parameter|unknown parameter name"):
        eng.update_weights({"nope.weight": torch.zeros(1)}, version=2)


def test_low_precision_rollout_shows_a_mismatch_and_fp32_none():
    """int8 always, and bf16 where the CPU has bf16 dot products, change the rollout's log-probs; a CPU
    without them (AVX2 only, say) serves bf16 as float32, so its log-probs are float32's exactly."""
    m = tiny()
    fp32 = rollout_logprobs(copy.deepcopy(m))
    again = rollout_logprobs(copy.deepcopy(m))
    assert [r.logprobs for r in fp32] == [r.logprobs for r in again]
    for dtype in ("bfloat16", "int8"):
        low = rollout_logprobs(to_serving_dtype(copy.deepcopy(m), dtype))
        # same seeds: compare the log-probs of the first token (same prompt, same RNG draw)
        diffs = [abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(fp32, low)]
        if dtype == "bfloat16" and not cpu_has_bf16():
            assert [r.logprobs for r in low] == [r.logprobs for r in fp32], "bf16 falls back to float32 here"
        else:
            assert max(diffs) > 1e-4, dtype



def _alone_and_batched(model) -> tuple:
    eng = LLMEngine(model, EngineConfig(max_seq_len=128, max_batch_size=8), eos_token_ids=[])

    def req(i):
        return GenerateRequest([1 + i, 7, 9, 3, 5 * i], SamplingParams(temperature=1.0, max_tokens=8, seed=10 + i, ignore_eos=True))

    return eng.generate([req(0)])[0], eng.generate([req(i) for i in range(6)])[0]


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch_in_every_cpu_serving_dtype():
    """float32, bf16 (row kernel: each row rounded alone) and int8 (each row its own scale, exact int32
    sums) give a request bitwise the same log-probs and tokens alone or beside five others."""
    from arborl.engine import cpu_kernels

    m = tiny()
    # float32 and bf16 are invariant through the row kernel; int8 through its own arithmetic
    dtypes = ("float32", "bfloat16", "int8") if cpu_kernels.available() else ("int8",)
    for dtype in dtypes:
        alone, batched = _alone_and_batched(to_serving_dtype(copy.deepcopy(m), dtype))
        assert alone.token_ids == batched.token_ids and alone.logprobs == batched.logprobs, dtype

def test_weights_dtype_knob_reaches_the_engines_and_not_the_trainer(tmp_path):
    cfg = load_config(None, ["model.source=tiny", "model.tiny_vocab=512", "engine.max_seq_len=64",
                             "engine.weights_dtype=int8", "gateway.num_engines=2", f"runs_dir={tmp_path}"])
    loaded = load_model(cfg.model)
    trainer_model = loaded.model
    serving = copy.deepcopy(trainer_model)
    import dataclasses

    built = build_gateway(cfg, loaded=dataclasses.replace(loaded, model=serving), run_dir=tmp_path / "r")
    try:
        models = [e.engine.runner.model for e in built.engines.engines]
        assert len(models) == 2 and all(is_low_precision(x) for x in models)
        assert not is_low_precision(trainer_model)
    finally:
        built.close()
    assert Config().engine.weights_dtype == "float32"


def test_fp8_reference_on_cpu():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    w8, scale = fp8_weight(lin.weight)
    assert w8.dtype == torch.float8_e4m3fn
    deq = w8.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 relative (plus the subnormal floor)
    assert ((deq - lin.weight).abs() <= lin.weight.abs() * 2**-4 + scale[:, None] * 2**-9).all()
    x = torch.randn(5, 32)
    ref = fp8_linear_reference(x, w8, scale, lin.bias)
    assert torch.allclose(ref, F.linear(x, deq, lin.bias), atol=1e-5)
    assert (ref - lin(x)).abs().max() < 0.05 * lin(x).abs().max()
    mod = Fp8Linear(lin)  # on CPU its forward is the reference
    assert torch.equal(mod(x), ref)


def test_fp8_serving_is_refused_on_cpu_with_the_reason():
    ok, why = fp8_available("cpu")
    assert not ok and "CUDA" in why
    with pytest.raises(LowPrecisionError, match="float8_e4m3: FP8 e4m3 GEMMs need a CUDA GPU"):
        to_serving_dtype(tiny(), "float8_e4m3")
    with pytest.raises(LowPrecisionError, match="use one of"):
        to_serving_dtype(tiny(), "int4")


@pytest.mark.skipif(not fp8_available()[0], reason=fp8_available()[1] or "no FP8 GPU")
def test_fp8_gemm_on_gpu_matches_the_reference():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).cuda()
    mod = Fp8Linear(lin)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    got = mod(x).float()
    ref = fp8_linear_reference(x.float(), mod.weight_q, mod.weight_scale, mod.bias).float()
    # the GPU also quantises the activations to e4m3: within a few per cent of the weight-only reference
    assert (got - ref).abs().max() < 0.08 * ref.abs().max()
    m = to_serving_dtype(load_model(TINY).model.cuda(), "float8_e4m3")
    assert is_low_precision(m)


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bfloat16 dot products (AVX512-BF16 / AMX-BF16)")
def test_cpu_bf16_rollout_runs_bf16_weights_and_kv_and_float32_elsewhere():
    from arborl.engine import cpu_kernels

    m = tiny()
    served = to_serving_dtype(copy.deepcopy(m), "bfloat16")
    linears = [x for x in served.modules() if isinstance(x, torch.nn.Linear)]
    assert linears and all(isinstance(x, Bf16Linear) for x in linears)
    tied = served.lm_head.weight is served.model.embed_tokens.weight
    for x in linears:  # bf16 values in bf16 storage; a weight tied to the embedding keeps its float32 storage
        shared = tied and x is served.lm_head
        assert x.weight.dtype == (torch.float32 if shared else torch.bfloat16)
        assert torch.equal(x.weight, x.weight.bfloat16().to(x.weight.dtype))
    assert served.model.embed_tokens.weight.dtype == torch.float32
    eng = LLMEngine(served, EngineConfig(max_seq_len=128, max_batch_size=4), eos_token_ids=[])
    runner = eng.runner
    assert runner.kv.layer(0)[0].dtype == torch.bfloat16 and runner.tree_kernel  # bf16 KV, read by the attention kernel
    if cpu_kernels.has_bf16():  # the GEMMs of decode rows on vdpbf16ps
        assert all(p.panels.dtype == torch.bfloat16 for p in runner.linear.packed_groups().values())
    low = rollout_logprobs(served)
    ref = rollout_logprobs(copy.deepcopy(m))
    diffs = [abs(a - b) for r, q in zip(ref, low) for a, b in zip(r.logprobs, q.logprobs) if r.token_ids == q.token_ids]
    assert diffs and 0 < max(diffs) < 0.05


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bfloat16 dot products (AVX512-BF16 / AMX-BF16)")
@pytest.mark.parametrize("tie", [False, True])
def test_cpu_bf16_serving_copy_holds_no_float32_shadow_and_samples_as_before(tie):
    """The serving copy's Linear weights are bf16 storage (half the bytes of the float32 storage they had),
    from a float32 or a bf16 model, and it samples bitwise what the float32-storage copy sampled."""
    from arborl.models import tiny_llama

    m = tiny_llama(layers=2, hidden=64, vocab=96, heads=4, kv_heads=2, seed=4, tie_embeddings=tie)
    served = to_serving_dtype(copy.deepcopy(m), "bfloat16")
    old_style = copy.deepcopy(m)  # every Linear rounded in its float32 storage: the copy before
    quantize._replace_linears(old_style, lambda x: Bf16Linear.convert(x, tied=True))
    linear_bytes = {id(x.weight): x.weight.nbytes for x in served.modules() if isinstance(x, Bf16Linear)
                    and not (tie and x is served.lm_head)}
    old_bytes = sum(x.weight.nbytes for x in old_style.modules() if isinstance(x, Bf16Linear)
                    and not (tie and x is old_style.lm_head))
    assert sum(linear_bytes.values()) * 2 == old_bytes
    new, old = rollout_logprobs(served), rollout_logprobs(old_style)
    assert [r.token_ids for r in new] == [r.token_ids for r in old]
    assert [r.logprobs for r in new] == [r.logprobs for r in old]
    from_bf16 = to_serving_dtype(copy.deepcopy(m).to(torch.bfloat16), "bfloat16")
    assert all(x.weight.dtype == torch.bfloat16 for x in from_bf16.modules()
               if isinstance(x, Bf16Linear) and not (tie and x is from_bf16.lm_head))
    assert from_bf16.model.embed_tokens.weight.dtype == torch.float32
    assert from_bf16.model.norm.weight.dtype == torch.float32


def test_bf16_on_a_cpu_without_bf16_dot_products_keeps_float32_and_says_so(monkeypatch, caplog):
    from arborl.models import quantize

    monkeypatch.setattr(quantize, "cpu_has_bf16", lambda: False)  # the CPU flag this machine may have
    m = tiny()
    with caplog.at_level("WARNING", logger="arborl.models.quantize"):
        served = to_serving_dtype(m, "bfloat16")
    assert served is m and next(m.parameters()).dtype == torch.float32 and not is_low_precision(m)
    assert "no bfloat16 dot products" in caplog.text and "serve float32" in caplog.text
