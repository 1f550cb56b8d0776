"""FSDP2's collectives through shared memory (train/host_collectives.py): the same bits as gloo's, slots
reused safely, oversized buffers through gloo, nothing left in /dev/shm, and FSDP2 ranks on one host use them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arborl.config import TrainConfig
from arborl.train.ranks import RankGroup
from helpers.host_collectives import compare_with_gloo, comm_kinds, shm_files
from helpers.parallel import make_samples, tiny


def _group(monkeypatch, reshard: bool = True) -> RankGroup:
    # the ranks import the rank-side checks from tests/helpers
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    cfg = TrainConfig(lr=1e-3, packing="tree", micro_batch_tokens=40,
                      parallel={"ranks": 2, "strategy": "fsdp2", "reshard_after_forward": reshard})
    return RankGroup(tiny(), cfg)


def test_shared_memory_collectives_give_gloos_bits(monkeypatch):
    with _group(monkeypatch) as group:
        reports = group.run(compare_with_gloo)
    for rank in (0, 1):
        rep = reports[rank]
        assert rep["slot_bytes"] >= 128 * 32 * 4  # the largest unit: the tiny model's embedding
        assert rep["files_after_setup"] == []  # unlinked once both ranks mapped them
        assert rep["ag"] == [True] * 5 and rep["rs"] == [True] * 5
        # all-gather slots 0, 1, 0, ...; reduce-scatter inputs in slots 2, 3, 2, ...; its outputs never in a slot
        assert [s[0] for s in rep["in_slot"]] == [0, 1, 0, 1, 0]
        assert [s[1] for s in rep["in_slot"]] == [2, 3, 2, 3, 2]
        assert all(s[2] is None for s in rep["in_slot"])
        assert rep["big_in_slot"] is None and rep["big_ag"]
    assert shm_files() == []


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_ranks_on_one_host_use_them(monkeypatch, reshard):
    with _group(monkeypatch, reshard) as group:
        group.train_step(make_samples(1))
        for rank in group.run(comm_kinds):
            assert rank == {"kinds": [("HostAllGather", "HostReduceScatter")], "files": []}
    assert shm_files() == []
