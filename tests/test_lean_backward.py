"""models/lean_backward.py: the decoder's RMSNorm and gated MLP keep less for the backward than
Hugging Face's modules do, with the modules' forward values bit for bit and their gradients within
float rounding; and the tree attention's float mask is kept once per batch, not once per layer."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from test_packing import assert_same, loss_and_grads
from test_trainer import make_samples
from transformers import LlamaConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from arborl.models import forward, tiny_llama
from arborl.models.lean_backward import gated_mlp, rms_norm
from arborl.train.packing import pack, packed_logprobs

VOCAB = 128


def _saved(fn, *args) -> list[torch.Tensor]:
    """The distinct tensors (by storage) autograd keeps for the backward of ``fn(*args)``, parameters aside."""
    seen: dict[int, torch.Tensor] = {}

    def keep(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = fn(*args)
    modules = [a for a in (fn, *args) if isinstance(a, torch.nn.Module)]
    params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    return out, [t for k, t in seen.items() if k not in params]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_forward_is_the_modules_bitwise_and_its_gradients_autograds(dtype):
    norm = LlamaRMSNorm(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, dtype=torch.float64).to(dtype))
    x = torch.randn(3, 7, 24, dtype=torch.float64).to(dtype).requires_grad_()
    lean, plain = rms_norm(norm, x), norm(x)
    assert torch.equal(lean, plain)
    tol = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # the norm computes in float32
    for a, b in zip(_grads(lean, [x, norm.weight]), _grads(plain, [x, norm.weight])):
        assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol * float(b.abs().max())), float((a - b).abs().max())


def test_rms_norm_keeps_the_input_and_one_float_a_row_not_the_normalised_copy():
    norm = LlamaRMSNorm(64).double()
    x = torch.randn(50, 64, dtype=torch.float64, requires_grad=True)
    _, lean = _saved(rms_norm, norm, x)
    _, plain = _saved(norm, x)
    assert sum(t.numel() for t in lean) == 50 * 64 + 50  # x and 1 / rms
    assert sum(t.numel() for t in plain) >= 2 * 50 * 64


def _mlp(dtype=torch.float64) -> LlamaMLP:
    cfg = LlamaConfig(hidden_size=16, intermediate_size=40, hidden_act="silu", num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    return LlamaMLP(cfg).to(dtype)


@pytest.mark.parametrize("lora_on_down", [False, True])
def test_gated_mlp_forward_is_the_modules_bitwise_and_every_gradient_autograds(lora_on_down):
    mlp = _mlp()
    if lora_on_down:  # the down projection is LoRA's: the product is handed to it
        mlp = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj", "up_proj"],
                                                 init_lora_weights=False), _Wrap(mlp)).mlp
        assert type(mlp.down_proj) is not torch.nn.Linear
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    lean, plain = gated_mlp(mlp, x), mlp(x)
    assert torch.equal(lean, plain)
    params = [p for p in mlp.parameters() if p.requires_grad]
    assert len(params) == (4 if lora_on_down else 3)  # LoRA: A and B on two projections, the base frozen
    for a, b in zip(_grads(lean, [x, *params]), _grads(plain, [x, *params])):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12 * float(b.abs().max())), float((a - b).abs().max())


class _Wrap(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.mlp = mlp


def test_gated_mlp_keeps_the_gate_and_up_outputs_only():
    mlp = _mlp()
    x = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    wide = 30 * 40  # one intermediate-wide tensor
    _, lean = _saved(gated_mlp, mlp, x)
    _, plain = _saved(mlp, x)
    assert sum(t.numel() for t in lean if t.shape[-1] == 40) == 2 * wide  # gate, up
    assert sum(t.numel() for t in plain if t.shape[-1] == 40) == 4 * wide  # gate, silu(gate), up, product
    mlp.down_proj.weight.requires_grad_(False)  # frozen down projection (LoRA elsewhere): the same two
    _, frozen = _saved(gated_mlp, mlp, x)
    assert sum(t.numel() for t in frozen if t.shape[-1] == 40) == 2 * wide


def test_no_grad_runs_the_modules_themselves():
    mlp, norm = _mlp(), LlamaRMSNorm(16).double()
    calls = []
    mlp.register_forward_hook(lambda *a: calls.append("mlp"))
    norm.register_forward_hook(lambda *a: calls.append("norm"))
    x = torch.randn(4, 16, dtype=torch.float64)
    with torch.no_grad():
        gated_mlp(mlp, x), rms_norm(norm, x)
    gated_mlp(mlp, x.requires_grad_()), rms_norm(norm, x)  # a hooked module keeps its own forward too
    assert calls == ["mlp", "norm", "mlp", "norm"]


def _qwen3(dtype=torch.float64):
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(3)
    return Qwen3ForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_trainers_log_probs_and_every_gradient_equal_the_modules_own_forward(monkeypatch, arch, checkpoint):
    m = tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=1, dtype=torch.float64) \
        if arch == "llama" else _qwen3()
    samples = [s.token_ids for s in make_samples(5, groups=2, size=3)]
    batch = pack(samples, mode="tree")
    lean = loss_and_grads(m, batch, samples, 0, checkpoint=checkpoint)
    monkeypatch.setattr(forward, "rms_norm", lambda norm, x: norm(x))
    monkeypatch.setattr(forward, "gated_mlp", lambda mlp, x: mlp(x))
    plain = loss_and_grads(m, batch, samples, 0, checkpoint=checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(lean[1], plain[1]))  # log-probs bit for bit
    assert_same(lean, plain, 1e-5)  # the norms compute in float32, even for a float64 model


def test_the_attention_mask_is_kept_once_per_batch_not_once_per_layer():
    m = tiny_llama(layers=4, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=1)
    batch = pack([list(range(1, 40))], mode="flat")
    masks: set[int] = set()

    def keep(t):
        if t.dim() == 4 and t.shape[1] == 1 and t.shape[2] <= 8:  # [1, 1, block's queries, keys] (not cos/sin)
            masks.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logps = packed_logprobs(m, batch, attention="blocks", block_size=8)
    sum(lp.sum() for lp in logps).backward()
    assert len(masks) == 5  # the five query blocks' causal masks, shared by the four layers
