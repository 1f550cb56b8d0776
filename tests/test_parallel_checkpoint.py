"""Sharded checkpoints of a rank group: written by 2 FSDP2 ranks (DCP), resumed by 2 ranks to the same
run, resharded into 1 rank, and the directory is an HF model transformers loads."""

from __future__ import annotations

import pytest
import torch

from arborl.config import TrainConfig
from arborl.train.parallel import full_params
from arborl.train.ranks import RankError, RankGroup
from helpers.parallel import alive, make_samples, tiny


def _cfg(ranks: int) -> TrainConfig:
    return TrainConfig(lr=1e-3, packing="tree", micro_batch_tokens=48, parallel={"ranks": ranks, "strategy": "fsdp2"})


def test_dcp_checkpoint_resumes_reshards_and_exports(tmp_path):
    a, b = make_samples(5, groups=4), make_samples(6, groups=4)
    ckpt = tmp_path / "ckpt"
    pids: list[int] = []
    with RankGroup(tiny(), _cfg(2)) as group:
        pids += group.pids
        group.train_step(a)
        group.save(ckpt, {"cursor": 7})
        group.train_step(b)
        straight = group.run(full_params)[0]
    assert (ckpt / "dcp").is_dir() and (ckpt / "model.safetensors").is_file()

    with RankGroup(tiny(seed=1), _cfg(2)) as group:  # other start weights: everything comes from the checkpoint
        pids += group.pids
        assert group.load(ckpt) == {"cursor": 7} and group.step == 1
        at_save = group.run(full_params)[0]
        group.train_step(b)
        resumed = group.run(full_params)[0]
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k  # the optimiser state came back too

    with RankGroup(tiny(seed=1), _cfg(1)) as group:  # DCP reshards 2 -> 1
        pids += group.pids
        group.load(ckpt)
        group.train_step(b)
        one = group.run(full_params)[0]
    for k in straight:
        assert torch.allclose(one[k], straight[k], rtol=1e-5, atol=1e-6), k

    from transformers import AutoModelForCausalLM

    hf = dict(AutoModelForCausalLM.from_pretrained(ckpt).named_parameters())
    for k, v in at_save.items():
        assert torch.equal(hf[k].detach(), v), k
    assert not alive(pids)


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    group = RankGroup(tiny(), _cfg(2))
    pids = group.pids
    try:
        with pytest.raises(RankError, match="not a sharded checkpoint"):
            group.load(tmp_path / "nope")
    finally:
        group.close()
    assert not alive(pids)
