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

import torch
from torch import nn

# the row count oneDNN picks its blocking for; decode batches are around it, other counts still run
_BATCH_HINT = 32


def packing_available(model: nn.Module) -> bool:
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinears:
    """``(module, x) -> module(x)`` from oneDNN-reordered copies of every plain float32 ``nn.Linear``
    of ``model`` (quantised or other layers run as they are)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._packed: dict[nn.Module, torch.Tensor] = {}
        self.refresh()

    def __len__(self) -> int:
        return len(self._packed)

    @torch.no_grad()
    def refresh(self) -> None:
        """Reorder the current weights (after a weight update)."""
        self._packed = {
            m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), _BATCH_HINT)
            for m in self.model.modules()
            if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        }

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = self._packed.get(module)
        if w is None:
            return module(x)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, w, module.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])
