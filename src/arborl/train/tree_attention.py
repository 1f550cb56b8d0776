"""Attention under a prefix-tree mask, for packed training rows.

One mask describes both flat and tree packing. Tokens are laid out in DFS pre-order, so the
tokens that may look at key ``j`` (``j`` itself and everything below it in the tree) are exactly
the contiguous range ``[j, vis_end[j])``:

    visible(q, kv)  <=>  kv <= q < vis_end[kv]

Flat packing is the special case where ``vis_end`` is the end of the key's own sample (a
block-diagonal causal mask); a padding token gets ``vis_end = position + 1`` (it sees only
itself, nothing sees it).

Three interchangeable backends, each an ``attend(q, k, v)`` for ``arborl.models.forward``
(q [b, Hq, s, d], k/v [b, Hkv, s, d]):

* ``blocks`` (default on CPU): all rows concatenated into one sequence; the queries are cut into
  blocks of ``block_size`` and each block runs SDPA over only the key blocks it can see (key
  block ``j`` is skipped when ``max(vis_end)`` over it is <= the query block's start), with
  the exact boolean mask on that small slice. Cost is that of the visible blocks: causal
  prompts cost half a dense mask, sibling branches of a GRPO group do not look at each other,
  and rows never look at each other.
* ``dense``: rows as a padded batch ``[rows, L]`` with a dense ``[rows, 1, L, L]`` boolean mask
  and SDPA: the simple reference (quadratic in ``L``).
* ``flex``: the same padded batch with ``torch.nn.attention.flex_attention`` and a block mask
  from the same ``mask_mod``; used where it runs forward *and* backward (CUDA, compiled).
  On CPU (torch 2.13) flex_attention has no backward ("FlexAttention does not support backward
  on CPU"), so there it is usable for no-grad forwards only (tests check its mask that way).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Backend = Literal["auto", "blocks", "dense", "flex"]


def visibility_mask(vis_end: torch.Tensor) -> torch.Tensor:
    """Dense boolean mask ``[..., L, L]`` (True = query row may attend to key column)."""
    L = vis_end.shape[-1]
    idx = torch.arange(L, device=vis_end.device)
    q = idx[:, None]
    kv = idx[None, :]
    return (kv <= q) & (q < vis_end.unsqueeze(-2))


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one SDPA makes of it (0 where visible, -inf elsewhere). Made once
    per batch and passed to every layer: SDPA keeps its mask for the backward, and a boolean mask it
    converts itself is a new float tensor kept per layer (2048 tokens of SmolLM2: 0.26 GB)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# --------------------------------------------------------------------------- blocks (CPU default)


@dataclass(frozen=True)
class _QueryBlock:
    q0: int
    q1: int
    k_range: tuple[int, int] | None  # one contiguous key range, sliced without a copy
    k_index: torch.Tensor | None  # else the gathered key positions
    mask: torch.Tensor | None  # [1, 1, q1-q0, keys] bool, None when every pair is visible


def block_plan(vis_end: torch.Tensor, block_size: int) -> list[_QueryBlock]:
    """Which key blocks each query block of one sequence ``[N]`` sees, with the exact mask."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    vis_end = vis_end.to("cpu")
    n = vis_end.shape[0]
    nb = math.ceil(n / block_size)
    padded = torch.zeros(nb * block_size, dtype=vis_end.dtype)
    padded[:n] = vis_end
    block_max_end = padded.view(nb, block_size).amax(dim=1)
    plan: list[_QueryBlock] = []
    for i in range(nb):
        q0, q1 = i * block_size, min(n, (i + 1) * block_size)
        # key block j < i is seen by some query of this block iff some key in it ends after q0;
        # the diagonal block is always seen (every token sees itself).
        seen = (torch.nonzero(block_max_end[:i] > q0).flatten().tolist()) + [i]
        ranges: list[list[int]] = []
        for j in seen:
            a, b = j * block_size, min(n, (j + 1) * block_size)
            if ranges and ranges[-1][1] == a:
                ranges[-1][1] = b
            else:
                ranges.append([a, b])
        k_index = torch.cat([torch.arange(a, b) for a, b in ranges])
        qi = torch.arange(q0, q1)[:, None]
        mask = (k_index[None, :] <= qi) & (qi < vis_end[k_index][None, :])
        plan.append(
            _QueryBlock(
                q0,
                q1,
                (ranges[0][0], ranges[0][1]) if len(ranges) == 1 else None,
                None if len(ranges) == 1 else k_index,
                None if bool(mask.all()) else mask[None, None],
            )
        )
    return plan


def blocks_attend(plan: list[_QueryBlock], scale: float, gqa: bool, device: torch.device) -> Attend:
    blocks = [
        _QueryBlock(
            b.q0,
            b.q1,
            b.k_range,
            None if b.k_index is None else b.k_index.to(device),
            None if b.mask is None else b.mask.to(device),
        )
        for b in plan
    ]
    additive: dict[torch.dtype, list[torch.Tensor | None]] = {}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        masks = additive.get(q.dtype)
        if masks is None:
            masks = additive[q.dtype] = [None if b.mask is None else additive_mask(b.mask, q.dtype) for b in blocks]
        outs = []
        for b, mask in zip(blocks, masks):
            if b.k_range is not None:
                ks, vs = k[:, :, b.k_range[0] : b.k_range[1]], v[:, :, b.k_range[0] : b.k_range[1]]
            else:
                ks, vs = k.index_select(2, b.k_index), v.index_select(2, b.k_index)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, b.q0 : b.q1], ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    return attend


# --------------------------------------------------------------------------- dense and flex


def dense_attend(vis_end: torch.Tensor, scale: float, gqa: bool) -> Attend:
    """``vis_end`` [rows, L] (padded); one dense boolean mask shared by every layer and head."""
    mask = visibility_mask(vis_end).unsqueeze(1)  # [rows, 1, L, L]
    additive: dict[torch.dtype, torch.Tensor] = {}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.dtype not in additive:
            additive[q.dtype] = additive_mask(mask, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive[q.dtype], scale=scale, enable_gqa=gqa)

    return attend


@functools.lru_cache(maxsize=2)
def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def flex_attend(vis_end: torch.Tensor, scale: float, gqa: bool, *, compiled: bool | None = None) -> Attend:
    """``vis_end`` [rows, L] (padded) as a flex_attention block mask. ``compiled`` defaults to
    True on CUDA; eager flex (CPU, tests) is a slow reference without backward on CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, L = vis_end.shape
    device = vis_end.device
    if compiled is None:
        compiled = device.type == "cuda"

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < vis_end[b, kv_idx])

    block_mask = create_block_mask(mask_mod, rows, None, L, L, device=str(device))
    fn = _flex_fn(compiled)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex warns that it is a debugging path
            return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)

    return attend


@functools.lru_cache(maxsize=8)
def flex_works(device: str) -> bool:
    """Whether compiled flex_attention runs forward and backward on ``device`` (probed once on a
    tiny GQA problem and checked against SDPA); False on CPU, where it has no backward."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        L, d = 128, 16
        q = torch.randn(1, 4, L, d, generator=g).to(dev).requires_grad_()
        k = torch.randn(1, 2, L, d, generator=g).to(dev).requires_grad_()
        v = torch.randn(1, 2, L, d, generator=g).to(dev).requires_grad_()
        end = torch.full((1, L), L, device=dev)
        end[0, 10:40] = 40  # a branch
        out = flex_attend(end, 0.25, True)(q, k, v)
        out.sum().backward()
        ref = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visibility_mask(end).unsqueeze(1), scale=0.25, enable_gqa=True
        )
        return bool(torch.allclose(out, ref, atol=1e-3, rtol=1e-3)) and q.grad is not None
    except Exception as e:  # noqa: BLE001 - any failure means: use the SDPA backends
        warnings.warn(f"flex_attention unusable on {device} ({type(e).__name__}: {e}); using SDPA blocks")
        return False


def resolve_backend(backend: Backend, device: torch.device) -> Literal["blocks", "dense", "flex"]:
    if backend == "auto":
        return "flex" if flex_works(str(device)) else "blocks"
    if backend not in ("blocks", "dense", "flex"):
        raise ValueError(f"attention backend must be auto, blocks, dense or flex, got {backend!r}")
    return backend
