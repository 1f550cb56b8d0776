"""Prepacked CPU weights for the engine's projections (``engine.cpu_packed_weights``).

A plain ``F.linear`` on CPU is MKL's sgemm over the weight as stored; at decode batch sizes (a few
to a few dozen rows) it spends its time re-laying-out that weight, worst on CPUs MKL does not tune
for. oneDNN's linear over a weight reordered once into its blocked layout (what vLLM's CPU build
runs) was 1.4-3.5x faster per projection on this machine's 2 cores at 8-32 rows, and the LM head
(49152 x 576 for SmolLM2) 2.6-3.5x. The reordered copies cost one extra copy of the Linear weights
and are rebuilt after every weight update; results differ from MKL's in the last bits (~1e-6
relative), like any other GEMM kernel choice. The trainer's forward never uses them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from arborl.engine.cpu_kernels import available as row_kernel_available, has_bf16
from arborl.engine.row_linear import row_linear, to_bf16_panels, to_int8_panels, to_panels
from arborl.models.lora import Adapter
from arborl.models.quantize import Bf16Linear, Int8Linear, shared_parameters
from arborl.types import ArborlError

# the row count oneDNN picks its blocking for; decode batches are around it, other counts still run
_BATCH_HINT = 32


def packing_available(model: nn.Module) -> bool:
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _plain(m: nn.Module) -> bool:
    dtypes = (torch.float32, torch.bfloat16) if type(m) is Bf16Linear else (torch.float32,)
    return type(m) in (nn.Linear, Bf16Linear) and m.weight.dtype in dtypes and m.weight.device.type == "cpu"


class PackedWeight(NamedTuple):
    """One packed projection (or side-by-side group): oneDNN's reordered weight (None where bf16 panels
    take every row count), the bias, each member's out_features, and the row kernel's panels (None where
    it is off; bfloat16 pairs for ``Bf16Linear`` weights where the CPU has bf16 dot products, else
    float32)."""

    onednn: torch.Tensor | None
    bias: torch.Tensor | None
    sizes: list[int]
    panels: torch.Tensor | None
    scales: torch.Tensor | None = None  # int8 panels' scale per output
    # the members' LoRA adapters side by side: A [ranks, in], B [outputs, ranks] block-diagonal, scale folded in
    lora: tuple[torch.Tensor, torch.Tensor] | None = None


# projections that read the same input, fused into one GEMM (fewer, larger GEMMs pay at decode row counts)
_FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class PackedLinears:
    """``(modules, x) -> each module(x)`` from oneDNN-reordered copies of the plain float32 ``nn.Linear``
    weights of ``model``; a decoder layer's q/k/v and gate/up are packed side by side and run as one
    GEMM each. Other modules (quantised, adapters) run as they are. Up to ``row_kernel_max_rows`` rows
    run arborl's row kernel (``engine.row_linear``) instead of oneDNN (0: never). ``Bf16Linear``
    weights (the CPU bf16 rollout) run there on bf16 dot products at every row count, and so do
    ``Int8Linear`` weights (the int8 rollout) on int8 dot products; with the kernel off those run as
    they are."""

    def __init__(self, model: nn.Module, row_kernel_max_rows: int = 0) -> None:
        self.model = model
        self.row_kernel_max_rows = row_kernel_max_rows if row_kernel_max_rows > 0 and row_kernel_available() else 0
        self._packed: dict[tuple[nn.Module, ...], PackedWeight] = {}
        self._held: dict[nn.Module, torch.Size] = {}  # modules whose weight lives only in the packs: its shape
        self._adapters: dict[nn.Module, Adapter] = {}
        self.refresh()

    def __len__(self) -> int:
        return len(self._packed)

    def packed_groups(self) -> dict[tuple[nn.Module, ...], PackedWeight]:
        """modules packed together -> their ``PackedWeight``; current weights."""
        return self._packed

    def held(self) -> dict[nn.Module, torch.Size]:
        """Modules whose weight was freed (``release_module_weights``): the packs hold it; a new one comes
        through ``refresh(weights)``."""
        return self._held

    def release_module_weights(self) -> int:
        """Free the packed modules' own weights (their values live in the packs); a weight another module
        shares (an LM head tied to the embedding, which the forward reads) stays, and so does a
        ``Bf16Linear``'s whose oneDNN path reads it. Returns the bytes freed."""
        tied = shared_parameters(self.model)
        freed = 0
        for mods, packed in self._packed.items():
            for m in mods:
                plain = type(m) is nn.Linear or (type(m) is Bf16Linear and packed.onednn is None)
                if not plain or m in self._held or id(m.weight) in tied:
                    continue
                self._held[m] = m.weight.shape
                freed += m.weight.nbytes
                m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        return freed

    def drop(self) -> int:
        """Free every pack: the engine's copy of these weights is gone until ``refresh`` builds the packs
        again from new weights (every module in ``held`` needs its new one then). Returns the bytes freed."""
        freed = sum(t.numel() * t.element_size() for w in self._packed.values()
                    for t in (w.onednn, w.panels, w.bias, w.scales) if t is not None)
        self._packed = {}
        return freed

    def _weight(self, m: nn.Module, new: dict[nn.Module, torch.Tensor]) -> torch.Tensor:
        if m in new:
            return new[m].detach().to(torch.float32)
        if m in self._held:
            raise ArborlError(f"{type(m).__name__}'s weight lives only in the engine's packs, which have none for it "
                              "(released, or never built): a weight update must carry it")
        return m.weight.detach()

    @torch.no_grad()
    def refresh(self, weights: dict[nn.Module, torch.Tensor] | None = None, changed: set[nn.Module] | None = None) -> None:
        """Reorder the current weights (at start and after a weight update: never read in place later);
        ``weights``: the new weights of modules whose own were freed (``held``), float32 values;
        ``changed``: the modules whose weights changed (None: all), the other groups keep their packs."""
        groups: list[tuple[nn.Module, ...]] = []
        fused: set[nn.Module] = set()
        for layer in getattr(getattr(self.model, "model", None), "layers", []):
            for parent, names in _FUSED:
                owner = getattr(layer, parent, None)
                mods = tuple(getattr(owner, n, None) for n in names)
                if all(m is not None and _plain(m) for m in mods) or all(self._int8(m) for m in mods):
                    groups.append(mods)
                    fused.update(mods)
        groups += [(m,) for m in self.model.modules() if (_plain(m) or self._int8(m)) and m not in fused]
        # each old pack goes before its replacement is built: one set of packed weights at a time
        old, self._packed = self._packed, {}
        for mods in groups:
            kept = old.pop(mods, None)
            if kept is None or changed is None or changed.intersection(mods):
                del kept
                kept = self._pack_int8(mods) if self._int8(mods[0]) else self._pack(mods, weights or {})
            self._packed[mods] = kept._replace(lora=self._group_lora(mods))

    def set_adapters(self, adapters: dict[nn.Module, Adapter]) -> set[nn.Module]:
        """Serve ``adapters`` (module -> LoRA adapter; replaces the previous set) on top of the packed base
        weights, which stay as they are. Returns the adapted modules that no pack holds (run as modules)."""
        self._adapters = dict(adapters)
        for mods, packed in self._packed.items():
            self._packed[mods] = packed._replace(lora=self._group_lora(mods))
        packed_mods = {m for mods in self._packed for m in mods}
        return set(adapters) - packed_mods

    def _group_lora(self, mods: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        ads = [self._adapters.get(m) for m in mods]
        if not any(ads):
            return None
        a = torch.cat([ad.a.float() for ad in ads if ad is not None])
        b = a.new_zeros(sum(m.out_features for m in mods), a.shape[0])
        row = col = 0
        for m, ad in zip(mods, ads):
            if ad is not None:
                r = ad.a.shape[0]
                b[row : row + m.out_features, col : col + r] = ad.b.float() * ad.scale
                col += r
            row += m.out_features
        return a, b

    def _int8(self, m: nn.Module | None) -> bool:
        """An int8 Linear the row kernel runs (at every row count); without the kernel it runs as it is."""
        return isinstance(m, Int8Linear) and self.row_kernel_max_rows > 0

    def _pack_int8(self, mods: tuple[nn.Module, ...]) -> PackedWeight:
        weight = torch.cat([m.weight_q for m in mods])
        bias = None
        if any(m.bias is not None for m in mods):
            bias = torch.cat([m.bias if m.bias is not None else m.weight_scale.new_zeros(m.out_features) for m in mods])
        return PackedWeight(None, bias, [m.out_features for m in mods], to_int8_panels(weight),
                            torch.cat([m.weight_scale for m in mods]))

    def _pack(self, mods: tuple[nn.Module, ...], new: dict[nn.Module, torch.Tensor]) -> PackedWeight:
        parts = [self._weight(m, new) for m in mods]
        weight = torch.cat(parts) if len(parts) > 1 else parts[0]
        bias = None
        if any(m.bias is not None for m in mods):
            bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                              for m in mods])
        bf16 = all(isinstance(m, Bf16Linear) for m in mods) and has_bf16()
        panels = (to_bf16_panels(weight) if bf16 else to_panels(weight)) if self.row_kernel_max_rows else None
        # bf16 panels take every row count, so no oneDNN copy (it was a third of a bf16 refresh's time)
        onednn = None if panels is not None and bf16 else torch.ops.mkldnn._reorder_linear_weight(weight.float(), _BATCH_HINT)
        return PackedWeight(onednn, bias, [m.out_features for m in mods], panels)

    def uses_panels(self, packed: PackedWeight, rows: int) -> bool:
        """Whether ``rows`` rows run on the row kernel's panels (else oneDNN's reordered weight)."""
        # bf16 panels take every row count: at a prefill's 64-650 rows the bf16 row kernel ran ~300
        # GFLOP/s against oneDNN's ~212 in float32 (SmolLM2's shapes, 2 cores), and a prompt's rows
        # are then rounded as its decode rows are
        return packed.panels is not None and (rows <= self.row_kernel_max_rows or packed.onednn is None)

    def linear(self, packed: PackedWeight, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + x @ W.T + bias`` for flat rows x [rows, in]: the row kernel up to
        ``row_kernel_max_rows`` rows (bf16 panels: every row count), oneDNN above (its ``add`` post-op
        for the residual)."""
        if self.uses_panels(packed, x.shape[0]):
            out = row_linear(x, packed.panels, sum(packed.sizes), packed.bias, residual, packed.scales)
        elif residual is None:
            out = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, packed.bias, "none", [], "")
        else:
            out = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed.onednn, packed.bias, "add")
        if packed.lora is not None:  # the adapters' low-rank term on top of the base weights
            a, b = packed.lora
            out.addmm_(x @ a.T, b.T)
        return out

    def __call__(self, mods: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = self._packed.get(mods)
        if packed is None:
            if len(mods) > 1:  # not packed together: each on its own
                return tuple(self((m,), x)[0] for m in mods)
            return (mods[0](x),)
        out = self.linear(packed, x.reshape(-1, x.shape[-1]))
        outs = out.split(packed.sizes, dim=-1) if len(packed.sizes) > 1 else (out,)
        return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in outs)
