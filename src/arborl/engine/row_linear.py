"""Projections at decode row counts (``csrc/row_linear.cpp``, ``engine.cpu_row_kernel_max_rows``).

A decode step multiplies 1-4 rows by every weight of the model; a draft-verify step 2-24. Both are
bound by reading the weights, and oneDNN's blocked GEMM re-reads a weight per block of 3-4 rows, so
its cost steps up with the rows (on this project's 2-core reference machine a verify of 6 rows cost
1.5x a decode of one). The kernel streams each weight once for all rows from a panel layout built at
weight-load time, and computes each output as one chain over the input features, so a token's
logits are bitwise the same decoded alone, in a batch, or as a node of a draft tree.

``to_bf16_panels`` stores a weight in bfloat16 pairs for AVX512-BF16's dot product (the bf16 rollout,
``engine.weights_dtype=bfloat16`` on CPU): half the bytes per step and twice the multiply-adds per
instruction; the rows are rounded to bfloat16 on the way in and every sum is float32.
``to_int8_panels`` stores an int8 weight (``engine.weights_dtype=int8``) in quads for AVX512-VNNI's int8
dot product: a quarter of the bytes; each row is quantised with its own scale and summed exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from arborl.engine.cpu_kernels import huge_zeros

PANEL = 16  # output columns per panel: two AVX2 registers


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16] contiguous: panel p, row k holds W[16p : 16p + 16, k]."""
    out, inp = weight.shape
    pad = -out % PANEL
    w = F.pad(weight.detach().float(), (0, 0, 0, pad)) if pad else weight.detach().float()
    return huge_zeros((w.shape[0] // PANEL, inp, PANEL), torch.float32).copy_(w.view(-1, PANEL, inp).transpose(1, 2))


def to_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> bfloat16 [ceil(out / 16), ceil(in / 2), 32]: panel p, pair row k holds
    W[16p + j, 2k + t] at 2j + t (an odd ``in`` padded with a zero column); rounded to nearest even."""
    out, inp = weight.shape
    w = weight.detach().float()
    if inp % 2 or out % PANEL:
        w = F.pad(w, (0, inp % 2, 0, -out % PANEL))
    p, k2 = w.shape[0] // PANEL, w.shape[1] // 2
    panels = huge_zeros((p, k2, 2 * PANEL), torch.bfloat16)
    # one strided pass that rounds as it copies (a reshape of the permuted view first made a float copy)
    panels.view(p, k2, PANEL, 2).copy_(w.view(p, PANEL, k2, 2).permute(0, 2, 1, 3))
    return panels


def to_int8_panels(weight_int8: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] -> uint8 [ceil(out / 16), ceil(in / 4), 64]: panel p, quad row k holds
    W[16p + j, 4k + t] + 128 at 4j + t (``in`` padded with zero weights)."""
    out, inp = weight_int8.shape
    w = weight_int8.to(torch.int16) + 128
    if inp % 4 or out % PANEL:
        w = F.pad(w, (0, -inp % 4, 0, -out % PANEL), value=128)
    p, k4 = w.shape[0] // PANEL, w.shape[1] // 4
    panels = huge_zeros((p, k4, 4 * PANEL), torch.uint8)
    panels.view(p, k4, PANEL, 4).copy_(w.view(p, PANEL, k4, 4).permute(0, 2, 1, 3))
    return panels


def row_linear(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + bias`` for x [rows, in] with W given as ``to_panels(W)`` (float32),
    ``to_bf16_panels(W)`` (x rounded to bfloat16, float32 sums) or ``to_int8_panels(Q)`` with ``scales``
    (quantize.Int8Linear's arithmetic: each row of x quantised to int8 with its own scale, exact int32
    sums, times both scales); [rows, n_out]."""
    return torch.ops.arborl.row_linear(x, panels, n_out, bias, residual, scales)
