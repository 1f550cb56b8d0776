"""The row kernel (engine/csrc/row_linear.cpp, engine.cpu_row_kernel_max_rows): the projection it
computes, a row's result independent of the other rows, its errors, and the knob that routes a
forward's rows to it or to oneDNN."""

from __future__ import annotations

import pytest
import torch

from arborl.config import EngineConfig
from arborl.engine import LLMEngine
from arborl.engine import cpu_kernels
from arborl.engine.cpu_kernels import available as row_kernel_available
from arborl.engine.model_runner import ModelRunner
from arborl.engine.row_linear import row_linear, to_bf16_panels, to_int8_panels, to_panels
from arborl.models import tiny_llama
from arborl.models.quantize import Int8Linear, cpu_has_bf16, int8_weight
from arborl.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.skipif(not row_kernel_available(), reason="arborl's CPU kernels did not build")


@pytest.mark.parametrize("n_out,k", [(16, 8), (37, 61), (576, 576), (40, 1536)])
def test_row_linear_is_the_projection_with_bias_and_residual(n_out, k):
    g = torch.Generator().manual_seed(n_out + k)
    w, b = torch.randn(n_out, k, generator=g), torch.randn(n_out, generator=g)
    panels = to_panels(w)
    assert panels.shape == (-(-n_out // 16), k, 16)
    for m in (1, 5, 6, 7, 13, 30):  # one register block, several, and a ragged last block
        x, res = torch.randn(m, k, generator=g), torch.randn(m, n_out, generator=g)
        want = res.double() + x.double() @ w.double().T + b.double()
        got = row_linear(x, panels, n_out, b, res)
        assert got.shape == (m, n_out)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * k**0.5)
        plain = x.double() @ w.double().T
        assert torch.allclose(row_linear(x, panels, n_out).double(), plain, rtol=1e-5, atol=1e-4 * k**0.5)


def test_a_rows_result_is_bitwise_the_same_whatever_the_other_rows():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 700, generator=g)  # K > one 256-wide chunk: several blocks resume chunk by chunk
    panels = to_panels(w)
    x = torch.randn(24, 700, generator=g)
    alone = torch.cat([row_linear(x[i : i + 1], panels, 300) for i in range(24)])
    for m in (2, 6, 7, 12, 24):
        assert torch.equal(row_linear(x[:m], panels, 300), alone[:m])
    assert torch.equal(row_linear(x.flip(0), panels, 300).flip(0), alone)


def test_the_best_path_of_this_cpu_is_chosen_and_every_path_can_be_forced():
    paths = cpu_kernels.isas()
    assert paths[0] == "scalar" and cpu_kernels.isa() == paths[-1]  # the best this CPU reports
    flags = open("/proc/cpuinfo").read()
    assert ("avx512_bf16" in paths) == (" avx512_bf16" in flags) == cpu_kernels.has_bf16() == cpu_has_bf16()
    assert ("avx512f" in paths) == (" avx512f" in flags)
    for name in paths:
        with cpu_kernels.forced_isa(name):
            assert cpu_kernels.isa() == name
        assert cpu_kernels.isa() == paths[-1]
    with pytest.raises(RuntimeError, match="not one of its paths"):
        with cpu_kernels.forced_isa("avx1024"):
            pass


@pytest.mark.parametrize("n_out,k", [(37, 61), (960, 576), (576, 1536)])
def test_every_isa_path_computes_bitwise_what_the_scalar_reference_does(n_out, k):
    """AVX2, AVX-512F (and for bf16 panels AVX512-BF16's vdpbf16ps) against the scalar path, for each
    row count of a register block and beyond; the float32 paths are also the float64 projection."""
    g = torch.Generator().manual_seed(k)
    w, b = torch.randn(n_out, k, generator=g), torch.randn(n_out, generator=g)
    f32, bf16 = to_panels(w), to_bf16_panels(w)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (-(-n_out // 16), -(-k // 2), 32)
    for m in (1, 6, 7, 16, 17, 32):
        x, res = torch.randn(m, k, generator=g), torch.randn(m, n_out, generator=g)
        with cpu_kernels.forced_isa("scalar"):
            ref32, ref16 = row_linear(x, f32, n_out, b, res), row_linear(x, bf16, n_out, b, res)
        for name in cpu_kernels.isas():
            with cpu_kernels.forced_isa(name):
                assert torch.equal(row_linear(x, f32, n_out, b, res), ref32), (name, m)
                assert torch.equal(row_linear(x, bf16, n_out, b, res), ref16), (name, m)
        # bf16 panels: the rows and the weight rounded to bf16 (nearest even), the sums in float32
        want = res.double() + x.bfloat16().double() @ w.bfloat16().double().T + b.double()
        scale = (x.abs().double() @ w.abs().double().T).max()
        assert ((ref16.double() - want).abs().max() / scale) < 1e-6
        assert ((ref32.double() - (res.double() + x.double() @ w.double().T + b.double())).abs().max() / scale) < 1e-6


def test_bf16_panels_keep_a_rows_result_independent_of_the_other_rows():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 701, generator=g)  # odd K (a zero-padded pair), several 256-pair chunks
    panels = to_bf16_panels(w)
    x = torch.randn(40, 701, generator=g)
    alone = torch.cat([row_linear(x[i : i + 1], panels, 300) for i in range(40)])
    for m in (2, 16, 17, 33, 40):
        assert torch.equal(row_linear(x[:m], panels, 300), alone[:m])



@pytest.mark.parametrize("n_out,k", [(37, 61), (960, 576), (576, 1536)])
def test_int8_panels_compute_bitwise_the_int8_linear_on_every_path(n_out, k):
    """Each row quantised with its own scale, exact int32 sums (VNNI's vpdpbusd, AVX2's 16-bit
    multiply-adds, the scalar loop), both scales: bitwise quantize.Int8Linear's torch arithmetic,
    with bias and residual, for each row count of a register block and beyond."""
    g = torch.Generator().manual_seed(k)
    mod = Int8Linear(torch.nn.Linear(k, n_out))
    panels = to_int8_panels(mod.weight_q)
    assert panels.dtype == torch.uint8 and panels.shape == (-(-n_out // 16), -(-k // 4), 64)
    for m in (1, 3, 4, 16, 17, 40):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4  # rows of different scale
        x[0] = 0.0 if m > 3 else x[0]  # a zero row: zero plus the bias
        res = torch.randn(m, n_out, generator=g)
        want = mod(x)
        for name in cpu_kernels.isas():
            with cpu_kernels.forced_isa(name):
                assert torch.equal(row_linear(x, panels, n_out, mod.bias, None, mod.weight_scale), want), (name, m)
                assert torch.equal(row_linear(x, panels, n_out, mod.bias, res, mod.weight_scale), want + res), (name, m)
        plain = x.double() @ (mod.weight_q.double() * mod.weight_scale.double()[:, None]).T + mod.bias.double()
        assert ((want.double() - plain).abs().max() / plain.abs().max()) < 0.03  # the rows' own quantisation


def test_int8_panels_keep_a_rows_result_independent_of_the_other_rows():
    g = torch.Generator().manual_seed(5)
    q, scale = int8_weight(torch.randn(300, 703, generator=g))  # K not a multiple of 4, several chunks
    panels = to_int8_panels(q)
    x = torch.randn(40, 703, generator=g)
    alone = torch.cat([row_linear(x[i : i + 1], panels, 300, None, None, scale) for i in range(40)])
    for m in (2, 16, 17, 33, 40):
        assert torch.equal(row_linear(x[:m], panels, 300, None, None, scale), alone[:m])
    with pytest.raises(RuntimeError, match="int8 panels take a scale per output"):
        row_linear(x, panels, 300)
    with pytest.raises(RuntimeError, match="scales must hold 300 floats"):
        row_linear(x, panels, 300, None, None, scale[:-1])

def test_bad_shapes_are_refused_with_what_to_fix():
    panels = to_panels(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        row_linear(torch.randn(2, 9), panels, 32)
    with pytest.raises(RuntimeError, match="2 panels cannot hold 40 outputs"):
        row_linear(torch.randn(2, 8), panels, 40)
    with pytest.raises(RuntimeError, match="residual must be float32 \\[2, 32\\]"):
        row_linear(torch.randn(2, 8), panels, 32, None, torch.randn(3, 32))
    with pytest.raises(RuntimeError, match="bias must hold 32 floats"):
        row_linear(torch.randn(2, 8), panels, 32, torch.randn(31))
    with pytest.raises(RuntimeError, match="2-d float32 CPU tensor"):
        row_linear(torch.randn(2, 8, dtype=torch.float64), panels, 32)
    assert row_linear(torch.randn(0, 8), panels, 32).shape == (0, 32)


def _model():
    return tiny_llama(layers=2, hidden=64, vocab=512, heads=4, kv_heads=2, seed=0)


def test_the_knob_routes_up_to_max_rows_to_the_kernel_and_larger_forwards_to_onednn(monkeypatch):
    from arborl.engine import packed

    rows_seen: list[int] = []

    def spy(x, *rest):
        rows_seen.append(x.shape[0])
        return row_linear(x, *rest)

    monkeypatch.setattr(packed, "row_linear", spy)

    def calls(fn) -> int:
        rows_seen.clear()
        fn()
        return len(rows_seen)

    model = _model()
    on = ModelRunner(model, slots=4, max_len=64, packed=True, row_kernel_max_rows=3)
    off = ModelRunner(model, slots=4, max_len=64, packed=True, row_kernel_max_rows=0)
    assert all(p.panels is not None for p in on.linear.packed_groups().values())
    assert all(p.panels is None for p in off.linear.packed_groups().values())  # no second copy of the weights
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    for r in (on, off):
        r.prefill([(s, p, 0) for s, p in enumerate(prompts)])
    layers = len(model.model.layers)
    per_forward = 4 * layers + 1  # q|k|v, o, gate|up, down per layer; the LM head
    assert calls(lambda: on.decode([1, 2, 3], [4, 3, 5])) == per_forward  # 3 rows: the kernel
    assert calls(lambda: off.decode([1, 2, 3], [4, 3, 5])) == 0
    assert calls(lambda: on.decode([1, 2, 3, 4], [5, 4, 6, 2])) == 0  # 4 rows: oneDNN
    off.decode([1, 2, 3, 4], [5, 4, 6, 2])
    # both paths compute the same projections (to rounding)
    a = on.decode([7, 8, 9], [6, 5, 7])
    b = off.decode([7, 8, 9], [6, 5, 7])
    assert torch.allclose(a, b, atol=1e-4)
    if cpu_kernels.has_bf16():  # bf16 panels (the CPU bf16 rollout) take every row count unless the knob is 0
        import copy

        from arborl.models.quantize import to_serving_dtype

        served = to_serving_dtype(copy.deepcopy(model), "bfloat16")
        on = ModelRunner(served, slots=4, max_len=64, packed=True, row_kernel_max_rows=3)
        off = ModelRunner(served, slots=4, max_len=64, packed=True, row_kernel_max_rows=0)
        # bf16 panels alone (no oneDNN copy beside them); with the kernel off, oneDNN's copy alone
        assert all(p.onednn is None and p.panels is not None for p in on.linear.packed_groups().values())
        assert all(p.onednn is not None and p.panels is None for p in off.linear.packed_groups().values())
        assert calls(lambda: on.decode([1, 2, 3, 4], [0, 0, 0, 0])) == per_forward
        assert calls(lambda: on.prefill([(s, p, 0) for s, p in enumerate(prompts)])) == per_forward
        assert calls(lambda: off.prefill([(s, p, 0) for s, p in enumerate(prompts)])) == 0
    # int8 panels take every row count too; with the kernel off the int8 Linears run as they are
    import copy

    from arborl.models.quantize import to_serving_dtype

    served = to_serving_dtype(copy.deepcopy(model), "int8")
    on = ModelRunner(served, slots=4, max_len=64, packed=True, row_kernel_max_rows=3)
    off = ModelRunner(served, slots=4, max_len=64, packed=True, row_kernel_max_rows=0)
    groups = on.linear.packed_groups()
    assert len(groups) == 2 * layers + layers * 2 + 1  # q|k|v and gate|up fused, o and down, the LM head
    assert all(p.panels.dtype == torch.uint8 and p.onednn is None for p in groups.values())
    assert len(off.linear.packed_groups()) == 0
    assert calls(lambda: on.prefill([(s, p, 0) for s, p in enumerate(prompts)])) == per_forward
    assert calls(lambda: on.decode([1, 2, 3, 4], [5, 4, 6, 2])) == per_forward
    off.prefill([(s, p, 0) for s, p in enumerate(prompts)])
    off.decode([1, 2, 3, 4], [5, 4, 6, 2])
    a, b = on.decode([7, 8, 9], [6, 5, 7]), off.decode([7, 8, 9], [6, 5, 7])
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()  # the same arithmetic (the rest of the forward aside)


def test_with_the_kernel_a_sequences_log_probs_do_not_depend_on_its_batch():
    model = _model()
    cfg = EngineConfig(max_seq_len=64, max_batch_size=4, cpu_row_kernel_max_rows=24)

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [9, 3]]
    batched = LLMEngine(model, cfg, eos_token_ids=[511]).generate([GenerateRequest(p, params) for p in prompts])
    for p, r in zip(prompts, batched):
        alone = LLMEngine(model, cfg, eos_token_ids=[511]).generate([GenerateRequest(p, params)])[0]
        assert alone.token_ids == r.token_ids and alone.logprobs == r.logprobs  # bitwise


def _thp_flag(ptr: int) -> str | None:
    """The ``THPeligible`` line of this process's mapping that holds ``ptr`` (None: no such field)."""
    start = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            start = lo if lo <= ptr < hi else None
        elif start is not None and head == "THPeligible:":
            return line.split()[1]
    return None


def test_streamed_tensors_are_asked_for_in_huge_pages():
    """Panels and the KV cache (what a decode step streams) are 2 MB-aligned allocations advised as
    huge pages; a small tensor is an ordinary one; either holds what is written to it."""
    big = cpu_kernels.huge_zeros((3, 1 << 20), torch.float32)
    assert big.shape == (3, 1 << 20) and big.dtype == torch.float32 and big.data_ptr() % (2 << 20) == 0
    assert not big.any()
    big.fill_(2.5)
    assert float(big.sum()) == 2.5 * 3 * (1 << 20)
    small = cpu_kernels.huge_zeros((4, 4), torch.bfloat16)
    assert small.shape == (4, 4) and small.dtype == torch.bfloat16 and not small.any()
    panels = to_panels(torch.randn(2048, 576))
    assert panels.data_ptr() % (2 << 20) == 0
    cache = LLMEngine(tiny_llama(), EngineConfig(max_seq_len=4096, max_batch_size=64), eos_token_ids=[0]).runner.kv
    cache.ensure(4096, 64)  # grown to every slot and the whole context: what a full batch streams
    for i in range(cache.num_layers):
        kv = cache.layer(i)[0]
        assert kv.data_ptr() % (2 << 20) == 0 and not kv.any()
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if __import__("os").path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    if "[never]" not in mode and _thp_flag(big.data_ptr()) is not None:
        assert _thp_flag(big.data_ptr()) == "1" and _thp_flag(panels.data_ptr()) == "1"
