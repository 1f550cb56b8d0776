"""The KV memory of running sequences: one preallocated tensor, one row ("slot") per sequence.

Layout ``[layers, 2 (k, v), slots, kv_heads, max_len, head_dim]``. Running sequences occupy slots
``0..n-1`` contiguously, so a decode step attends over the view ``[:, :, :n, :, :L]`` without
gathering; when a sequence leaves, the last one is moved into its slot (one copy of one sequence).
"""

from __future__ import annotations

import torch


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
        self.data = torch.zeros(layers, 2, slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[layer, 0], self.data[layer, 1]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of the KV of positions [start, end) of a slot: ``[layers, 2, kv_heads, end-start, head_dim]``."""
        return self.data[:, :, slot, :, start:end].clone()

    def write(self, slot: int, start: int, kv: torch.Tensor) -> None:
        self.data[:, :, slot, :, start : start + kv.shape[3]] = kv

    def move(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self.data[:, :, dst, :, :length] = self.data[:, :, src, :, :length]

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
