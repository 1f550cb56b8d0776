"""Projections at decode row counts (``csrc/row_linear.cpp``, ``engine.cpu_row_kernel_max_rows``).

A decode step multiplies 1-4 rows by every weight of the model; a draft-verify step 2-24. Both are
bound by reading the weights, and oneDNN's blocked GEMM re-reads a weight per block of 3-4 rows, so
its cost steps up with the rows (on this project's 2-core reference machine a verify of 6 rows cost
1.5x a decode of one). The kernel streams each weight once for all rows from a panel layout built at
weight-load time, and computes each output as one chain over the input features, so a token's
logits are bitwise the same decoded alone, in a batch, or as a node of a draft tree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16  # output columns per panel: two AVX2 registers


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16] contiguous: panel p, row k holds W[16p : 16p + 16, k]."""
    out, inp = weight.shape
    pad = -out % PANEL
    w = F.pad(weight.detach().float(), (0, 0, 0, pad)) if pad else weight.detach().float()
    return w.view(-1, PANEL, inp).transpose(1, 2).contiguous()


def row_linear(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` for x [rows, in] with W given as ``to_panels(W)``; [rows, n_out]."""
    return torch.ops.arborl.row_linear(x, panels, n_out, bias, residual)
