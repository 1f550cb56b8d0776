"""The KV memory of running sequences: one preallocated tensor per layer, one row ("slot") per sequence.

Each layer's layout is ``[2 (k, v), slots, kv_heads, capacity, head_dim]``. Running sequences occupy
slots ``0..n-1`` contiguously, so a decode step attends over the view ``[:, :n, :, :L]`` without
gathering; when a sequence leaves, the last one is moved into its slot (one copy of one sequence).
The capacity grows (doubling, up to ``max_len``) as sequences get longer, and the slot rows (doubling,
up to ``max_batch_size``) as more sequences run at once, so a workload pays for the context and the
batch it uses, not for the largest ones allowed (16 episodes of 2048 tokens on SmolLM2: 1.5 GB of
float32 KV, where 32 preallocated slots held 3.0 GB). Growth goes one layer at a time, each old
layer freed as soon as it is copied, so it needs one layer's new tensor more than the grown cache,
not the old cache and the new one together (one tensor for all layers spiked the code-repair job's
evaluations by the whole old cache, 0.7-1.5 GB). Memory is zeroed because masked-out positions still
enter the attention kernel, and garbage there could be NaN.
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
        self.max_slots = slots
        self._first = (min(4, slots), min(256, max_len))  # rows and capacity of the first allocation
        shape = [2, self._first[0], kv_heads, self._first[1], head_dim]
        self._layers = [_zeros(shape, dtype, torch.device(device)) for _ in range(layers)]

    @property
    def capacity(self) -> int:
        return self._layers[0].shape[3]

    @property
    def slots(self) -> int:
        """Slot rows allocated now (<= max_slots)."""
        return self._layers[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._layers)

    def shrink(self) -> int:
        """Back to the first allocation (rows and capacity), the rest freed: nothing may be running. Returns
        the bytes freed."""
        before = self.nbytes
        self._regrow(*self._first, keep=False)
        return max(before - self.nbytes, 0)

    def ensure(self, length: int, slots: int = 1) -> None:
        """Make room for positions [0, length) in slots [0, slots)."""
        if length <= self.capacity and slots <= self.slots:
            return
        if length > self.max_len:
            raise ValueError(f"KV length {length} exceeds max_len {self.max_len}")
        if slots > self.max_slots:
            raise ValueError(f"KV slot {slots - 1} exceeds the {self.max_slots} slots (engine.max_batch_size)")
        rows, capacity = self.slots, self.capacity
        if length > capacity:
            capacity = min(self.max_len, max(length, 2 * capacity))
        if slots > rows:
            rows = min(self.max_slots, max(slots, 2 * rows))
        self._regrow(rows, capacity, keep=True)

    def _regrow(self, rows: int, capacity: int, *, keep: bool) -> None:
        """Each layer to ``rows`` slots of ``capacity`` positions, copying what fits if ``keep``; the old
        layer is dropped before the next one is allocated."""
        for i, old in enumerate(self._layers):
            shape = list(old.shape)
            shape[1], shape[3] = rows, capacity
            new = _zeros(shape, old.dtype, old.device)
            if keep:
                r, c = min(rows, old.shape[1]), min(capacity, old.shape[3])
                new[:, :r, :, :c] = old[:, :r, :, :c]
            self._layers[i] = new
            del old

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._layers[layer]
        return t[0], t[1]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of the KV of positions [start, end) of a slot: ``[layers, 2, kv_heads, end-start, head_dim]``."""
        return torch.stack([t[:, slot, :, start:end] for t in self._layers])

    def write(self, slot: int, start: int, kv: torch.Tensor) -> None:
        self.ensure(start + kv.shape[3], slot + 1)
        end = start + kv.shape[3]
        for t, src in zip(self._layers, kv):
            t[:, slot, :, start:end] = src

    def move(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            for t in self._layers:
                t[:, dst, :, :length] = t[:, src, :, :length]

    def copy_positions(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Within one slot, KV of positions ``src`` to positions ``dst`` (an accepted draft path that
        was verified at tree positions moves to consecutive ones)."""
        if src != dst:
            d = self._layers[0].device
            src_pos, dst_pos = torch.tensor(src, device=d), torch.tensor(dst, device=d)
            for t in self._layers:
                t[:, slot, :, dst_pos] = t[:, slot, :, src_pos]
