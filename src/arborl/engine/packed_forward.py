"""The engine's decoder forward over prepacked CPU weights (``engine.cpu_packed_weights``).

The same computation as ``models.forward.decoder_hidden`` with ``PackedLinears`` (and, measured,
bit-for-bit the same logits), written for the serving case of a plain Llama-layout decoder: the
weights are passed to the kernels directly instead of through module calls, rows stay flat
``[tokens, hidden]``, q and k get their rotary embedding in place in the fused q|k|v output, the
residual adds ride on the o and down projections' GEMMs, and RMSNorm, the rotary embedding and SiLU
times up are one pass each (``csrc/decode_ops.cpp``; torch ops where arborl's kernels did not build).
At decode batch sizes the ops around the GEMMs were a quarter of a step (measured: 18% of a step at
batch 4, 29% at batch 32), so fewer of them is what this buys; the
trainer keeps running ``decoder_hidden`` on the modules. Models this does not cover (Qwen3's
per-head q/k norms, other activations, adapters, quantised projections) run ``decoder_hidden``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from arborl.engine.cpu_kernels import available
from arborl.engine.packed import PackedLinears
from arborl.models.forward import Attend, rope


def _rms_norm_ok(norm: nn.Module) -> bool:
    # Llama / Qwen2 / Mistral RMSNorm: weight * x / rms(x), eps in ``variance_epsilon``
    return type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon") and "Gemma" not in type(norm).__name__


class PackedForward:
    """``hidden(input_ids, position_ids, make_attend)`` with ``decoder_hidden``'s contract, over the
    packed weights of ``linears`` (looked up per call, so a weight refresh needs nothing here)."""

    def __init__(self, model: nn.Module, linears: PackedLinears) -> None:
        self.model = model
        self.linears = linears
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.hidden_size = cfg.hidden_size
        self._keys = [
            ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (layer.mlp.gate_proj, layer.mlp.up_proj), (layer.mlp.down_proj,))
            for layer in model.model.layers
            for a in (layer.self_attn,)
        ]

    @staticmethod
    def supports(model: nn.Module, linears: PackedLinears) -> bool:
        """Every layer a plain pre-norm Llama block whose projections ``linears`` packed (q|k|v, gate|up fused)."""
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(decoder, "layers") or getattr(model.config, "hidden_act", None) != "silu":
            return False
        packed = linears.packed_groups()
        for layer in decoder.layers:
            a, mlp = layer.self_attn, layer.mlp
            if hasattr(a, "q_norm") or not all(_rms_norm_ok(n) for n in (layer.input_layernorm, layer.post_attention_layernorm)):
                return False
            get = lambda owner, *names: tuple(getattr(owner, n, None) for n in names)  # noqa: E731 - MoE MLPs lack them
            groups = (get(a, "q_proj", "k_proj", "v_proj"), get(a, "o_proj"), get(mlp, "gate_proj", "up_proj"), get(mlp, "down_proj"))
            if not all(g in packed for g in groups):
                return False
        return True

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, make_attend: Callable[[int], Attend]) -> torch.Tensor:
        """Hidden states [b, s, hidden] before the final norm."""
        decoder = self.model.model
        b, s = input_ids.shape
        hd, nq, nkv, width = self.head_dim, self.heads, self.kv_heads, self.hidden_size
        h = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(h, position_ids)
        h = h.view(b * s, width)
        ops = _FUSED if available() else _TORCH
        cos, sin = cos.reshape(b * s, hd), sin.reshape(b * s, hd)
        packed = self.linears.packed_groups()
        linear = self.linears.linear
        for i, layer in enumerate(decoder.layers):
            qkv_k, o_k, gu_k, down_k = self._keys[i]
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            qkv = linear(packed[qkv_k], ops.rms_norm(h, ln1.weight, ln1.variance_epsilon))
            ops.rotary_(qkv, cos, sin, nq + nkv)
            heads = qkv.view(b, s, nq + 2 * nkv, hd).transpose(1, 2)
            out = make_attend(i)(heads[:, :nq], heads[:, nq : nq + nkv], heads[:, nq + nkv :])
            h = linear(packed[o_k], out.transpose(1, 2).reshape(b * s, nq * hd), h)
            gate_up = linear(packed[gu_k], ops.rms_norm(h, ln2.weight, ln2.variance_epsilon))
            h = linear(packed[down_k], ops.silu_mul(gate_up), h)
        return h.view(b, s, width)


class _TorchOps:
    """The element-wise steps as torch ops (where arborl's kernels did not build)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        d = cos.shape[-1]
        v = x[:, : heads * d].view(x.shape[0], heads, d)
        v.copy_(rope(v, cos[:, None], sin[:, None]))

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        inner = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inner]).mul_(gate_up[:, inner:])


class _FusedOps:
    """The element-wise steps as arborl's one-pass kernels (``csrc/decode_ops.cpp``)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.arborl.rms_norm(x, weight, eps)

    @staticmethod
    def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        torch.ops.arborl.rotary_(x, cos, sin, heads)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.arborl.silu_mul(gate_up)


_TORCH, _FUSED = _TorchOps(), _FusedOps()
