"""The element-wise steps of the packed decoder forward as one-pass kernels (engine/csrc/decode_ops.cpp):
each against its torch definition, a row's result independent of how many rows run (decode vs a
prefill split over threads), clear errors on bad input, and the forward on them against the forward
on torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arborl.engine import packed_forward
from arborl.engine.cpu_kernels import available

pytestmark = pytest.mark.skipif(not available(), reason="arborl's CPU kernels did not build")
OPS, TORCH = packed_forward._FUSED, packed_forward._TORCH


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_rms_norm_is_torchs_to_float_rounding_and_row_independent(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g) * 3, torch.randn(576, generator=g)
    got = OPS.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x.double(), (576,), w.double(), 1e-5)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(OPS.rms_norm(x[-1:], w, 1e-5), got[-1:])  # alone == among 300 (threads)


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_rotary_in_place_is_bitwise_torchs(rows):
    g = torch.Generator().manual_seed(rows)
    heads, d = 12, 64
    x = torch.randn(rows, (heads + 3) * d, generator=g)
    cos, sin = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    want = x.clone()
    TORCH.rotary_(want, cos, sin, heads)
    got = x.clone()
    OPS.rotary_(got, cos, sin, heads)
    assert torch.equal(got, want)
    assert torch.equal(got[:, heads * d :], x[:, heads * d :])  # the v heads untouched
    assert not torch.equal(got, x)


@pytest.mark.parametrize("rows", [1, 32, 200])
def test_silu_mul_is_torchs_to_float_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    gu = torch.randn(rows, 2 * 1536, generator=g) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped ends
    got = OPS.silu_mul(gu)
    want = TORCH.silu_mul(gu.double())
    assert torch.allclose(got.double(), want, rtol=2e-6, atol=1e-30)
    assert torch.equal(OPS.silu_mul(gu[-1:]), got[-1:])


def test_bad_inputs_are_refused_with_what_to_fix():
    with pytest.raises(RuntimeError, match="weight must hold 8 floats"):
        OPS.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        OPS.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="do not fit a row"):
        OPS.rotary_(torch.randn(2, 64), torch.randn(2, 16), torch.randn(2, 16), 5)
    with pytest.raises(RuntimeError, match="even width"):
        OPS.silu_mul(torch.randn(2, 7))


@torch.inference_mode()
def test_the_packed_forward_on_the_kernels_gives_the_logits_of_torch_ops(monkeypatch):
    from arborl.config import EngineConfig
    from arborl.engine import LLMEngine
    from arborl.models import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(layers=3, hidden=128, heads=4).eval()
    runner = LLMEngine(model, EngineConfig(max_seq_len=128, max_batch_size=4), eos_token_ids=[0]).runner
    assert runner.packed_forward is not None
    prompts = [[5, 9, 11, 3, 2], [7, 7, 1], [4, 8, 15, 16, 23, 42]]

    def logits(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(packed_forward, "available", lambda: fused)
        out = [runner.prefill([(i, p, 0) for i, p in enumerate(prompts)])]
        out.append(runner.decode([3, 4, 5], [len(p) for p in prompts]))
        return out

    for a, b in zip(logits(True), logits(False)):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
        assert not torch.equal(a, torch.zeros_like(a))
