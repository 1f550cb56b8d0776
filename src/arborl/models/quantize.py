r"""Low-precision serving copies of the policy (I5): the engines serve the policy in bfloat16, int8
(CPU) or FP8 e4m3 weight-only (CUDA GPUs that have FP8), while the trainer keeps its fp32
weights. ``engine.weights_dtype`` picks one; every weight update the trainer publishes is converted on
arrival (:func:`load_serving_weights`). The gap between the two policies is what the rollout-mismatch
metrics (``mismatch/*``) measure and what ``train.correction`` (TIS / MIS / IcePop) corrects.

* ``bfloat16``: on a CPU with bfloat16 dot products (AVX512-BF16 / AMX-BF16), every ``nn.Linear``
  becomes a :class:`Bf16Linear` (its weight rounded to bf16, in bf16 storage: no float32 shadow) and the engine
  runs those GEMMs on the CPU's bf16 dot products (``engine.row_linear``: bf16 weights and rows,
  float32 sums) and keeps the KV cache in bf16 where its attention kernel reads it (widened exactly,
  float32 sums); the rest (embeddings, norms, log-probs) stays float32. On a CPU
  without them bf16 GEMMs are no faster, so the serving copy stays float32 and a warning says so. On
  a GPU the whole model (and so the KV cache) is bf16.
* ``int8``: every ``nn.Linear`` (projections, MLPs, LM head) becomes an :class:`Int8Linear`: int8 weights
  quantised per output channel, symmetric (scale_o = max_i |W_oi| / 127, W_q = round(W / scale_o)), and
  each input row quantised the same way with its own scale (per token); their products are summed
  exactly in int32 and scaled back: y = float(sum) * scale_row * scale_o. The engine runs it on its row
  kernel (``engine/csrc/row_linear.cpp``: AVX512-VNNI's int8 dot products, else 16-bit multiply-adds)
  at every row count; elsewhere ``forward`` computes the same numbers with torch ops. Exact sums and a
  scale per row make a row's result independent of the other rows: a seeded request samples the same
  tokens alone or in any batch, as in float32 and bf16. (torch's dynamic int8 Linear, used before, took
  one activation scale per batch, so its rollouts depended on the batch.) Embeddings and norms stay
  float32. CPU only.
* ``float8_e4m3``: every ``nn.Linear`` becomes :class:`Fp8Linear`: e4m3 weights with a per-output-channel
  scale (max |W_o| / 448), and on a CUDA GPU of compute capability >= 8.9 a ``torch._scaled_mm`` FP8
  GEMM (activations quantised per tensor). Elsewhere serving refuses it with the reason;
  :func:`fp8_linear_reference` is the same arithmetic in plain float (what the tests check on CPU).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from arborl.types import ArborlError

log = logging.getLogger(__name__)

WEIGHTS_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3")
FP8_MAX = 448.0  # largest finite e4m3 value


class LowPrecisionError(ArborlError, ValueError):
    """A low-precision serving mode this machine cannot run; the message says what to use instead."""


# ----------------------------------------------------------------------------- int8 weight-only


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scale [out]): per-output-channel symmetric, scale = max |w_o| / 127."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` [rows, in] as int8 with a float32 scale each [rows, 1] (max |x_r| / 127)."""
    scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


class PerChannelLinear(nn.Module):
    """A Linear whose weight is held quantised per output channel (``weight_q``, with a float32
    ``weight_scale`` per output) by ``quantise``; what the trainer publishes is quantised again on
    arrival (``set_weight``). Int8Linear and Fp8Linear add their own forward."""

    def __init__(self, linear: nn.Linear, quantise) -> None:  # noqa: ANN001 - (w) -> (weight_q, scale)
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._quantise = quantise
        wq, scale = quantise(linear.weight)
        dev = linear.weight.device
        self.register_buffer("weight_q", wq.to(dev))
        self.register_buffer("weight_scale", scale.to(dev))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def set_weight(self, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        wq, scale = self._quantise(w.to(self.weight_q.device))
        self.weight_q.copy_(wq)
        self.weight_scale.copy_(scale)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)


class Int8Linear(PerChannelLinear):
    """A Linear with int8 weights (a scale per output) that quantises each input row with its own scale
    and sums the int8 products exactly in int32 (CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, int8_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, row_scale = int8_rows(x.reshape(-1, shape[-1]).float())
        y = torch._int_mm(xq, self.weight_q.t()).float() * row_scale * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


# ----------------------------------------------------------------------------- bf16 weights on CPU


def cpu_has_bf16() -> bool:
    """Whether this CPU reports bfloat16 dot products (x86 AVX512-BF16 or AMX-BF16)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


class Bf16Linear(nn.Linear):
    """An ``nn.Linear`` whose weight holds bfloat16 values (the CPU bf16 rollout), in bfloat16 storage: no
    float32 shadow of them. A weight tied to another module (an LM head sharing the embedding, which the
    engine reads in float32) keeps the shared float32 storage, rounded to bf16 values. The engine's packed
    path runs it on bf16 dot products; anywhere else it is ``F.linear`` on those values, widened. Weight
    updates are rounded on arrival (``set_weight``)."""

    @classmethod
    def convert(cls, linear: nn.Linear, *, tied: bool = False) -> "Bf16Linear":
        linear.__class__ = cls  # same module, its weight rounded
        with torch.no_grad():
            if tied:
                if linear.weight.dtype != torch.float32:
                    linear.weight.data = linear.weight.data.float()
                linear.weight.copy_(linear.weight.to(torch.bfloat16))
            else:
                linear.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
            if linear.bias is not None and linear.bias.dtype != torch.float32:
                linear.bias.data = linear.bias.data.float()
        return linear  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)

    @torch.no_grad()
    def set_weight(self, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight.copy_(w.to(torch.bfloat16))
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)


# ----------------------------------------------------------------------------- FP8 e4m3 weight-only


def fp8_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """(can this device run the FP8 GEMM, why not)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False, "FP8 e4m3 GEMMs need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper); this is a CPU"
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no float8_e4m3fn / _scaled_mm"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        return False, f"the GPU has compute capability {major}.{minor}; FP8 GEMMs need >= 8.9"
    return True, ""


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [out, in], float32 scale [out]) with scale_o = max |w_o| / 448."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def fp8_linear_reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The FP8 weight-only Linear in plain float: x @ (w8 * scale)^T + b (runs anywhere)."""
    w = w8.to(torch.float32) * scale[:, None]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


class Fp8Linear(PerChannelLinear):
    """A Linear with e4m3 weights and per-channel scales; ``_scaled_mm`` on FP8 GPUs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, fp8_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda and self.in_features % 16 == 0 and self.out_features % 16 == 0:
            sa = (x2.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
            xq = (x2.float() / sa).to(torch.float8_e4m3fn)
            one = torch.ones((), device=x2.device, dtype=torch.float32)
            y = torch._scaled_mm(xq, self.weight_q.t(), scale_a=sa, scale_b=one, out_dtype=torch.bfloat16)
            y = (y.float() * self.weight_scale[None, :])
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        else:
            y = fp8_linear_reference(x2, self.weight_q, self.weight_scale, self.bias)
        return y.reshape(*shape[:-1], self.out_features)


# ----------------------------------------------------------------------------- conversion and updates


def _replace_linears(module: nn.Module, make) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _replace_linears(child, make)


def shared_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters more than one module holds (an LM head tied to the embedding)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared


@torch.no_grad()
def _float_the_rest(model: nn.Module) -> None:
    """Every floating tensor but a Bf16Linear's weight to float32, one tensor at a time (``model.float()``
    would first make a float32 copy of a bf16 model's every weight, the ones about to be dropped too)."""
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32 and not (isinstance(m, Bf16Linear) and name == "weight"):
                p.data = p.data.float()
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                setattr(m, name, b.float())


def to_serving_dtype(model: nn.Module, weights_dtype: str) -> nn.Module:
    """Convert the engines' copy of the policy in place (idempotent) and return it."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise LowPrecisionError(f"engine.weights_dtype={weights_dtype!r}: use one of {', '.join(WEIGHTS_DTYPES)}")
    if weights_dtype == "float32":
        return model
    device = next(model.parameters()).device
    if weights_dtype == "bfloat16":
        if device.type != "cpu":
            return model.to(torch.bfloat16)
        if not cpu_has_bf16():
            log.warning("engine.weights_dtype=bfloat16: this CPU has no bfloat16 dot products (AVX512-BF16 or "
                        "AMX-BF16), where bf16 GEMMs are slower than float32; the engines serve float32")
            return model
        # tensor by tensor (a whole-model model.float() made a float32 copy of a bf16 model's every weight)
        tied = shared_parameters(model)
        _replace_linears(model, lambda m: Bf16Linear.convert(m, tied=id(m.weight) in tied))
        _float_the_rest(model)
        return model
    if weights_dtype == "int8":
        if device.type != "cpu":
            raise LowPrecisionError("engine.weights_dtype=int8 runs oneDNN's CPU int8 GEMM: serve on the CPU "
                                    "(model.device=cpu), or use bfloat16 / float8_e4m3 on a GPU")
        _replace_linears(model, Int8Linear)
        _float_the_rest(model)
        return model
    ok, why = fp8_available(device)
    if not ok:
        raise LowPrecisionError(f"engine.weights_dtype=float8_e4m3: {why}; use int8 (CPU) or bfloat16")
    model.to(torch.bfloat16)
    _replace_linears(model, Fp8Linear)
    return model


def has_bf16_linears(model: nn.Module) -> bool:
    """Whether the model is a CPU bf16 serving copy (holds ``Bf16Linear`` modules)."""
    return any(isinstance(m, Bf16Linear) for m in model.modules())


def is_low_precision(model: nn.Module) -> bool:
    """Whether the model holds converted (int8 / FP8 / CPU bf16) Linear modules."""
    return any(isinstance(m, (PerChannelLinear, Bf16Linear)) for m in model.modules())


@torch.no_grad()
def load_serving_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Publish trainer weights (float, plain names ``...q_proj.weight``) into a converted model: an int8
    / FP8 / bf16 Linear's weight is re-quantised (rounded), every other tensor copied (and cast) as it is."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    quantised: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if isinstance(modules.get(prefix), (PerChannelLinear, Bf16Linear)) and leaf in ("weight", "bias"):
            quantised.setdefault(prefix, {})[leaf] = tensor
        elif name in params:
            if params[name].shape != tensor.shape:
                raise ArborlError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(params[name].shape)}")
            params[name].copy_(tensor)
        else:
            raise ArborlError(f"update_weights: unknown parameter name {name!r}")
    for prefix, parts in quantised.items():
        mod = modules[prefix]
        if "weight" not in parts:
            raise ArborlError(f"update_weights: {prefix}.bias without its weight (a quantised Linear is set whole)")
        w, b = parts["weight"], parts.get("bias")
        if tuple(w.shape) != (mod.out_features, mod.in_features):
            raise ArborlError(f"update_weights: {prefix}.weight has shape {tuple(w.shape)}, "
                              f"expected {(mod.out_features, mod.in_features)}")
        mod.set_weight(w, b)
