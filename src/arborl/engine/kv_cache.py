"""The KV memory of running sequences: one preallocated tensor, one row ("slot") per sequence.

Layout ``[layers, 2 (k, v), slots, kv_heads, capacity, head_dim]``. Running sequences occupy slots
``0..n-1`` contiguously, so a decode step attends over the view ``[:, :, :n, :, :L]`` without
gathering; when a sequence leaves, the last one is moved into its slot (one copy of one sequence).
The capacity grows (doubling, up to ``max_len``) as sequences get longer, so short workloads never
pay for zeroing the full context. Memory is zeroed because masked-out positions still enter the
attention kernel, and garbage there could be NaN.
"""

from __future__ import annotations

import torch

from arborl.engine.cpu_kernels import huge_zeros


def _zeros(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in 2 MB pages (every decode step streams the cache), touched here: the first
    touch of a 2 MB page may make the kernel compact memory, which left to the first prefill cost it
    15 ms per admitted prompt (SmolLM2, batch 32) instead of ~0.3 s once, at creation."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_zeros(shape, dtype).zero_()


class SlotKVCache:
    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.max_len = max_len
        self.slots = slots
        self.data = _zeros([layers, 2, slots, kv_heads, min(256, max_len), head_dim], dtype, torch.device(device))

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def ensure(self, length: int) -> None:
        """Make room for positions [0, length) in every slot."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"KV length {length} exceeds max_len {self.max_len}")
        shape = list(self.data.shape)
        shape[4] = min(self.max_len, max(length, 2 * self.capacity))
        grown = _zeros(shape, self.data.dtype, self.data.device)
        grown[:, :, :, :, : self.capacity] = self.data
        self.data = grown

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[layer, 0], self.data[layer, 1]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of the KV of positions [start, end) of a slot: ``[layers, 2, kv_heads, end-start, head_dim]``."""
        return self.data[:, :, slot, :, start:end].clone()

    def write(self, slot: int, start: int, kv: torch.Tensor) -> None:
        self.ensure(start + kv.shape[3])
        self.data[:, :, slot, :, start : start + kv.shape[3]] = kv

    def move(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self.data[:, :, dst, :, :length] = self.data[:, :, src, :, :length]

    def copy_positions(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Within one slot, KV of positions ``src`` to positions ``dst`` (an accepted draft path that
        was verified at tree positions moves to consecutive ones)."""
        if src != dst:
            d = self.data.device
            self.data[:, :, slot, :, torch.tensor(dst, device=d)] = self.data[:, :, slot, :, torch.tensor(src, device=d)]
