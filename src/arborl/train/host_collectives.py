"""FSDP2's all-gather and reduce-scatter through shared memory, for gloo ranks on one host.

gloo moves every byte through TCP loopback (a copy into the kernel and one out, on gloo's worker
threads), and its ``reduce_scatter_tensor`` clones its whole input and reduces all of it on every
rank. Profiled on SmolLM2-135M, 2 ranks x 1 thread on 2 cores (torch.profiler, 2026-12-04): in a
~6 s step, the clone took 245 ms and gloo's two worker threads 1.16 s of CPU beside the ranks'
compute, whose matrix products took what one process's do (2.2-2.3 s). Through shared memory the
same step took 3.7-4.1 s (1 process x 2 threads: 3.1-3.5 s, the same minute).

Here each rank owns a few slots in a shared-memory file that every rank of the group maps. FSDP2
asks its communication object for the buffers it fills (``Comm.allocate``), so

* all-gather: FSDP2 copies a rank's shard straight into its own slot (the all-gather output, at the
  rank's offset); after a barrier each rank copies the other ranks' shards out of their slots;
* reduce-scatter: FSDP2 writes a rank's unsharded gradients into its slot; after a barrier rank r
  adds up chunk r of every rank's slot, in rank order (with 2 ranks bitwise gloo's sum: a+b == b+a).

A rank reads a peer's slot only between the barrier that opens a call and the barrier that opens
the next call, and each kind of call turns over two slots, so a slot is written again only after
every rank has left the call that read it. The buffers of a call larger than a slot (none with the
slot sized from the largest FSDP unit) and any other device go through torch's own collective; the
choice depends only on sizes, so every rank makes the same one.

The files are unlinked as soon as every rank has mapped them (before the first step): a rank that
dies later leaves nothing in /dev/shm. Memory: 4 slots of the largest unit per rank (SmolLM2-135M: its root unit,
the 113 MB tied embedding, so 452 MB of shared memory per rank).
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import tempfile
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

_ALIGN = 64
SLOTS_PER_KIND = 2


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostSegments:
    """Every rank's shared-memory slots, mapped in every rank of ``group`` (all on this host)."""

    def __init__(self, group: dist.ProcessGroup | None, slot_bytes: int, slots: int) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self.slots = slots
        tag = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(tag, group_src=0, group=group)
        paths = [os.path.join(_shm_dir(), f"arborl-fsdp-{tag[0]}-{r}") for r in range(self.world)]
        size = self.slot_bytes * slots
        self._maps: list[mmap.mmap] = []
        try:
            self._maps.append(self._map(paths[self.rank], size, create=True))
            dist.barrier(group=group)
            for r in range(self.world):
                if r != self.rank:
                    self._maps.append(self._map(paths[r], size, create=False))
            dist.barrier(group=group)
        finally:
            with _suppress_missing():
                os.unlink(paths[self.rank])
        dist.barrier(group=group)  # every rank's file is gone once any rank goes on
        own = self._maps.pop(0)
        self._maps.insert(self.rank, own)
        self.buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]

    @staticmethod
    def _map(path: str, size: int, *, create: bool) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def view(self, rank: int, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.buffers[rank][start:start + nbytes]

    def slot_of(self, t: torch.Tensor) -> int | None:
        """The slot of this rank's segment that ``t`` lies in, None if it lies elsewhere."""
        if t.device.type != "cpu":
            return None
        base = self.buffers[self.rank].data_ptr()
        offset = t.data_ptr() - base
        if not 0 <= offset < self.slot_bytes * self.slots:
            return None
        slot = offset // self.slot_bytes
        if offset + t.numel() * t.element_size() > (slot + 1) * self.slot_bytes:
            return None
        return slot

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class _suppress_missing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is FileNotFoundError


class _SlotComm:
    def __init__(self, segments: HostSegments, first_slot: int) -> None:
        self.segments = segments
        self.first = first_slot
        self.turn = 0

    def _take(self, size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        nbytes = numel * dtype.itemsize
        if device.type != "cpu" or nbytes > self.segments.slot_bytes:
            return torch.empty(*size, dtype=dtype, device=device)
        slot = self.first + self.turn
        self.turn = (self.turn + 1) % SLOTS_PER_KIND
        return self.segments.view(self.segments.rank, slot, nbytes).view(dtype).view(*size)

    def _peer_chunk(self, rank: int, slot: int, like: torch.Tensor, index: int) -> torch.Tensor:
        """Chunk ``index`` (``like``'s size) of ``rank``'s slot, read as ``like``'s dtype."""
        nbytes = like.numel() * like.element_size()
        return self.segments.view(rank, slot, nbytes * (index + 1))[nbytes * index:].view(like.dtype).view(like.shape)


class HostAllGather(_SlotComm, AllGather):
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``) through the ranks' shared slots."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._take(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        seg = self.segments
        slot = seg.slot_of(output_tensor)
        if slot is None:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        chunks = output_tensor.view(seg.world, -1)
        if input_tensor.data_ptr() != chunks[seg.rank].data_ptr():  # FSDP2 copies the shard in place; others may not
            chunks[seg.rank].copy_(input_tensor.reshape(-1))
        seg.barrier()
        for r in range(seg.world):
            if r != seg.rank:
                chunks[r].copy_(self._peer_chunk(r, slot, chunks[r], r))
        return None


class HostReduceScatter(_SlotComm, ReduceScatter):
    """FSDP2's sum reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) through the shared slots.

    FSDP2 allocates a reduce-scatter's input, then its output (which may become the sharded gradient,
    so it must not live in a slot): allocations alternate slot / ordinary memory, and a call checks it."""

    def __init__(self, segments: HostSegments, first_slot: int) -> None:
        super().__init__(segments, first_slot)
        self._input_next = True

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        is_input, self._input_next = self._input_next, not self._input_next
        if is_input:
            return self._take(size, dtype, device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp | None = None, async_op: bool = False) -> dist.Work | None:
        seg = self.segments
        if seg.slot_of(output_tensor) is not None:
            raise RuntimeError("HostReduceScatter: the output lies in a shared slot (FSDP2 allocated in another order)")
        slot = seg.slot_of(input_tensor)
        if slot is None or op not in (None, dist.ReduceOp.SUM):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op or dist.ReduceOp.SUM, group=group,
                                              async_op=async_op)
        seg.barrier()
        parts = [self._peer_chunk(r, slot, output_tensor, seg.rank) for r in range(seg.world)]
        torch.add(parts[0], parts[1], out=output_tensor)
        for part in parts[2:]:
            output_tensor.add_(part)
        return None


def host_comms(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> tuple[HostAllGather, HostReduceScatter] | None:
    """The shared-memory all-gather and reduce-scatter for ``model``'s FSDP2 units (call before
    ``fully_shard``: the slots are sized from the largest unit), or None where they do not apply
    (another backend, one rank, or ranks on several hosts)."""
    world = dist.get_world_size(group)
    if world < 2 or dist.get_backend(group) != "gloo":
        return None
    if int(os.environ.get("LOCAL_WORLD_SIZE", "0")) != world:
        return None
    in_layers: set[int] = set()
    units = []
    for layer in model.model.layers:
        ps = list(layer.parameters())
        in_layers.update(id(p) for p in ps)
        units.append(ps)
    units.append([p for p in model.parameters() if id(p) not in in_layers])

    def padded_bytes(ps: list[torch.Tensor]) -> int:
        total = 0
        for p in ps:
            rows = -(-p.shape[0] // world) * world if p.dim() else world
            total += rows * math.prod(p.shape[1:]) * max(p.element_size(), 4)
        return total

    slot_bytes = max(padded_bytes(ps) for ps in units)
    segments = HostSegments(group, slot_bytes, 2 * SLOTS_PER_KIND)
    return HostAllGather(segments, 0), HostReduceScatter(segments, SLOTS_PER_KIND)
