"""The shared decoder forward, for training and for inference.

It drives a Hugging Face decoder's own modules (Llama / Qwen2 / Qwen3 / Mistral layout:
embeddings, norms, q/k/v/o projections, MLPs, rotary embedding, LM head) and leaves only attention
to the caller, through ``make_attend(layer) -> attend(q, k, v)``: the engine attends over its KV
slots, tree packing attends under an ancestor mask. Sharing this code keeps the trainer's and the
engine's numbers the same. Under autograd the Llama family's RMSNorms and gated MLP run as
``models/lean_backward.py``'s functions: the modules' values, less kept for the backward. The engine's
CPU default for a Llama-layout model is a second, leaner forward over packed weights
(``engine/packed_forward.py``); ``tests/test_engine_perf.py`` ties its logits to this one.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from arborl.heap import release_free_memory
from arborl.models.lean_backward import gated_mlp, rms_norm
from arborl.types import ArborlError

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, k, v [b, h, s, d] -> [b, hq, s, d]
# (Linear modules that read the same x, x) -> each module's output; lets inference run projections from
# its own copy of the weights (the engine's prepacked CPU weights, q/k/v and gate/up fused into one GEMM
# each). None = call the modules, the trainer's path.
Linear = Callable[[tuple[nn.Module, ...], torch.Tensor], tuple[torch.Tensor, ...]]


class UnsupportedModelError(ArborlError):
    """The model's architecture is not one arborl's forward can run."""


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    vocab_size: int

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.num_heads

    @classmethod
    def of(cls, model: nn.Module, max_len: int | None = None) -> "DecoderShape":
        cfg = model.config
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"{type(model).__name__}: expected a causal LM with .model.layers and .lm_head (Llama/Qwen2 layout)"
            )
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) and max_len and window < max_len:
            raise UnsupportedModelError(
                f"sliding-window attention ({window} tokens) is not supported; keep sequences <= {window} tokens"
            )
        attn = decoder.layers[0].self_attn
        heads = cfg.num_attention_heads
        return cls(
            layers=len(decoder.layers),
            num_heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=attn.head_dim,
            scaling=attn.scaling,
            vocab_size=model.get_input_embeddings().weight.shape[0],
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding, ``x * cos + rotate_half(x) * sin`` (the engine's kernel is held bitwise to it)."""
    return x * cos + _rotate_half(x) * sin


def _call(modules: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(m(x) for m in modules)


def _mlp(mlp: nn.Module, x: torch.Tensor, linear: Linear | None) -> torch.Tensor:
    if linear is None:
        return gated_mlp(mlp, x)
    if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return mlp(x)
    # the gated MLP of the Llama family, written out so its projections go through ``linear``
    gate, up = linear((mlp.gate_proj, mlp.up_proj), x)
    return linear((mlp.down_proj,), mlp.act_fn(gate) * up)[0]


def decoder_layer(
    layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, linear: Linear | None = None
) -> torch.Tensor:
    """One decoder layer (attention + MLP, both residual) over hidden states ``h`` [b, s, hidden]."""
    lin = linear or _call
    attn = layer.self_attn
    b, s, _ = h.shape
    x = rms_norm(layer.input_layernorm, h)
    q, k, v = (t.view(b, s, -1, attn.head_dim) for t in lin((attn.q_proj, attn.k_proj, attn.v_proj), x))
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    q = rope(q.transpose(1, 2), cos, sin)
    k = rope(k.transpose(1, 2), cos, sin)
    out = attend(q, k, v.transpose(1, 2))
    h = h + lin((attn.o_proj,), out.transpose(1, 2).reshape(b, s, -1))[0]
    return h + _mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, h), linear)


def decoder_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    make_attend: Callable[[int], Attend],
    linear: Linear | None = None,
    *,
    checkpoint: bool | int = False,
    trim_heap: bool = False,
) -> torch.Tensor:
    """Decoder layers over ``input_ids`` [b, s] at ``position_ids`` [b, s]; returns hidden states
    [b, s, hidden] before the final norm.

    ``checkpoint`` (activation checkpointing, ``train.activation_checkpointing``): when gradients are
    on, each layer keeps only its input for the backward and runs again there
    (``torch.utils.checkpoint``, non-reentrant): activation memory of one layer instead of all of
    them, for one more forward's compute. The same operations on the same inputs: the gradients are
    those of the plain forward. An int ``n`` (``train.activation_checkpointing_layers``) checkpoints the
    first ``n`` layers only; the others keep their activations.

    ``trim_heap`` (``train.release_heap_per_layer``): the C heap's free pages go back to the system after
    each layer's forward and after its backward, which includes its recompute (``malloc_trim``). A layer's transients come in
    many sizes (attention blocks, MLP activations) and interleave with the tensors kept for the backward,
    so without it the heap grows by the freed transients of every layer. Values and gradients unchanged."""
    decoder = model.model
    h = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(h, position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    checkpointed = (len(decoder.layers) if checkpoint is True else int(checkpoint)) if torch.is_grad_enabled() else 0
    body = _trimmed_layer if trim_heap else decoder_layer
    recomputed = functools.partial(_recomputed_layer, body)
    for i, layer in enumerate(decoder.layers):
        run = recomputed if i < checkpointed else body
        if trim_heap and h.requires_grad:  # fires once the gradient of the layer's input is computed
            h.register_hook(_trim_after_backward)
        args = (layer, h, cos, sin, make_attend(i), linear)
        # a layer made call-through (train.parallel shards it with FSDP2) runs its body inside its own
        # __call__, so the hooks that gather and free its parameters run around it
        h = layer(run, *args) if getattr(layer, CALL_THROUGH, False) else run(*args)
    return h


def _recomputed_layer(body: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False)


def _trimmed_layer(*args) -> torch.Tensor:
    # under checkpointing torch stops the recompute early, once it has what the backward needs: the trim
    # below runs after the forward only, and the backward's hook trims after the recompute
    out = decoder_layer(*args)
    release_free_memory()
    return out


def _trim_after_backward(grad: torch.Tensor) -> None:
    release_free_memory()


CALL_THROUGH = "_arborl_call_through"


def _call_through(self: nn.Module, fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def make_call_through(module: nn.Module) -> nn.Module:
    """Make ``module(fn, *args)`` run ``fn(*args)`` under the module's own ``__call__`` (its forward
    hooks around it): how a module wrapped by a distributed engine (FSDP2 gathers a layer's
    parameters in a forward pre-hook) runs arborl's own forward code. ``decoder_hidden`` calls such
    layers through; the caller calls such a root model through."""
    module.forward = types.MethodType(_call_through, module)
    setattr(module, CALL_THROUGH, True)
    return module


def lm_logits(model: nn.Module, hidden: torch.Tensor, linear: Linear | None = None) -> torch.Tensor:
    """Final norm + LM head."""
    return (linear or _call)((model.lm_head,), model.model.norm(hidden))[0]
