"""The engine's decode / tree-verify attention kernel (``csrc/tree_attention.cpp``), built on first use.

Why our own kernel: CPU SDPA's results move with the batch, the padded key length and the number of
query rows (1e-8..2e-7 per layer, ~4e-5 in the log-probs after 30 layers), so a token verified in a
draft tree, or decoded beside other sequences, did not get the log-prob it gets decoded alone. This
kernel walks each row's keys in one fixed order, so those are bitwise equal; and at decode shapes it
is faster than SDPA's flash kernel (no mask, no padded keys, each KV head read once for its group of
query heads). ``engine.attention`` picks it ("auto": when it builds and the cache is float32).
"""

from __future__ import annotations

import torch

from arborl.engine.cpu_kernels import available, build_error
from arborl.types import ArborlError

__all__ = ["available", "build_error", "tree_attention"]


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_slot: torch.Tensor,
    prefix: torch.Tensor,
    extra: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of query rows ``q`` [R, Hq, D] over the KV cache ``[slots, Hkv, capacity, D]``: row r
    attends to positions [0, prefix[r]) of slot row_slot[r], then to the positions ``extra[r]`` lists
    (-1 = none) in that order. ``new_kv`` = (k [R, Hkv, D], v, write_pos [R]): each row's own K/V,
    written to its slot at write_pos[r] before any row attends. Returns [R, Hq, D]."""
    if not available():
        raise ArborlError(f"the tree-attention kernel is unavailable: {build_error()}")
    k_new, v_new, write_pos = new_kv if new_kv is not None else (None, None, None)
    return torch.ops.arborl.tree_attention(q, k_cache, v_cache, row_slot, prefix, extra, scale, k_new, v_new, write_pos)
