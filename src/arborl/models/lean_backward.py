"""The decoder's RMSNorm and gated MLP as autograd functions that keep less for the backward.

Run as Hugging Face writes them, autograd keeps, per token and layer, for each RMSNorm its float32
input *and* its normalised copy, and for the gated MLP four intermediate-wide tensors: the gate's
output (for SiLU), SiLU's output and the up projection (for the product), and the product (for the
down projection's weight gradient). SmolLM2-135M without activation checkpointing: 1.5 MB a token,
of which these are 0.6 MB.

* ``rms_norm``: keeps the input and one float per row (1 / rms); the backward recomputes the
  normalised input from them.
* ``gated_mlp``: keeps the gate's and the up projection's outputs; the backward recomputes
  ``silu(gate) * up`` (pointwise, a small fraction of the projections' cost) for the down projection's
  weight gradient and SiLU's derivative. Where the down projection is not a plain bias-free Linear
  (LoRA on it, a quantised layer), the product is handed to it and it keeps what it needs.

The forward runs the same operations on the same tensors as the modules: values are bitwise those of
``module(x)``; gradients are the same formulas and equal autograd's within float rounding
(tests/test_lean_backward.py). Only for the module types checked below; any other norm or MLP runs
its own ``forward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
_SILU = frozenset({"SiLU", "SiLUActivation"})


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(torch.float32) * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * xhat.to(x.dtype)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            dy = (grad * weight).to(torch.float32)
            grad_x = (rstd * (dy - xhat * (dy * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


class _GatedSiLU(torch.autograd.Function):
    """``silu(gate) * up``, then ``F.linear(., weight)`` when ``weight`` is given."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        product = F.silu(gate) * up
        return product if weight is None else F.linear(product, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        sig, act = torch.sigmoid(gate), F.silu(gate)  # act: the forward's own op, so the product is bitwise the forward's
        grad_w = None
        if weight is None:
            d_product = grad
        else:
            if ctx.needs_input_grad[2]:
                product = act * up
                grad_w = grad.reshape(-1, grad.shape[-1]).t().mm(product.reshape(-1, product.shape[-1]))
                del product
            d_product = grad.matmul(weight)
        grad_up = d_product * act if ctx.needs_input_grad[1] else None
        grad_gate = d_product * up * (sig * (1 + gate * (1 - sig))) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_w


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; under autograd, for the Llama family's RMSNorm, keeping only ``x`` and 1 / rms."""
    if not torch.is_grad_enabled() or type(norm).__name__ not in _RMS_NORMS or _hooked(norm):
        return norm(x)
    return _RMSNorm.apply(x, norm.weight, norm.variance_epsilon)


def gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)`` for the Llama family's gated MLP, ``down(silu(gate(x)) * up(x))``; under autograd
    keeping only the gate's and up projection's outputs (module docstring)."""
    act = getattr(mlp, "act_fn", None)
    if not torch.is_grad_enabled() or type(act).__name__ not in _SILU or _hooked(mlp) or not all(
            hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
        return mlp(x)
    gate, up, down = mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj
    if type(down) is nn.Linear and down.bias is None and not _hooked(down):
        return _GatedSiLU.apply(gate, up, down.weight)
    return down(_GatedSiLU.apply(gate, up, None))
