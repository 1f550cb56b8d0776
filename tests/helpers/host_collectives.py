"""Rank-side checks of train/host_collectives.py (run in spawned gloo processes and in trainer ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def shm_files() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("arborl-fsdp-")) if os.path.isdir("/dev/shm") else []


def compare_with_gloo(trainer) -> dict:
    """In a rank of a 2-rank group: both collectives against gloo's on the same inputs, over rounds that
    reuse every slot, plus a buffer too large for a slot (gloo's path)."""
    from arborl.models import tiny_llama
    from arborl.train.host_collectives import HostAllGather, HostReduceScatter, host_comms

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    comms = host_comms(tiny_llama(layers=2, hidden=32, vocab=128, heads=4, kv_heads=2, seed=0))
    assert comms is not None
    ag, rs = comms
    assert isinstance(ag, HostAllGather) and isinstance(rs, HostReduceScatter)
    report = {"files_after_setup": shm_files(), "slot_bytes": ag.segments.slot_bytes, "ag": [], "rs": [], "in_slot": []}
    for step in range(5):  # 5 rounds: each of the 2 slots per kind written again while the peer works
        n = 97 + step  # an odd size: chunks not aligned to anything
        out = ag.allocate((world * n,), dtype=torch.float32, device=torch.device("cpu"))
        mine = out.view(world, -1)[rank]
        mine.copy_(torch.randn(n))
        ref = torch.empty(world * n)
        dist.all_gather_into_tensor(ref, mine.clone())
        ag(out, mine, None)
        report["ag"].append(torch.equal(out, ref))
        inp = rs.allocate((world * n,), dtype=torch.float32, device=torch.device("cpu"))
        inp.copy_(torch.randn(world * n))
        res = rs.allocate((n,), dtype=torch.float32, device=torch.device("cpu"))
        report["in_slot"].append((ag.segments.slot_of(out), ag.segments.slot_of(inp), ag.segments.slot_of(res)))
        ref = torch.empty(n)
        dist.reduce_scatter_tensor(ref, inp.clone())
        rs(res, inp, None, dist.ReduceOp.SUM)
        report["rs"].append(torch.equal(res, ref))
    big = ag.segments.slot_bytes // 4 + world  # more float32 elements than a slot holds
    out = ag.allocate((world * big,), dtype=torch.float32, device=torch.device("cpu"))
    report["big_in_slot"] = ag.segments.slot_of(out)
    mine = out.view(world, -1)[rank]
    mine.copy_(torch.randn(big))
    ref = torch.empty(world * big)
    dist.all_gather_into_tensor(ref, mine.clone())
    ag(out, mine, None)
    report["big_ag"] = torch.equal(out, ref)
    return report


def comm_kinds(trainer) -> dict:
    """The all-gather / reduce-scatter classes the rank's FSDP2 units use, and any shared-memory file left."""
    from torch.distributed.fsdp import FSDPModule

    kinds = set()
    for m in trainer.model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                kinds.add((type(group._all_gather_comm).__name__, type(group._reduce_scatter_comm).__name__))
    return {"kinds": sorted(kinds), "files": shm_files()}
