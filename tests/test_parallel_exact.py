"""train.parallel: 2 ranks (gloo, 1 thread each) give the one process's update on the same batch,
with tree packing on, under DDP and FSDP2; the rank processes are gone afterwards."""

from __future__ import annotations

import pytest
import torch

from arborl.config import TrainConfig
from arborl.train.parallel import check_supported, full_grads, full_params
from arborl.train.ranks import RankGroup
from arborl.train.trainer import Trainer
from arborl.types import InvalidRequestError
from arborl_bench.parallel_bench import rel_diff
from helpers.parallel import alive, make_samples, tiny



def _cfg(strategy: str, ranks: int, **kw) -> TrainConfig:
    base = dict(lr=1e-3, packing="tree", micro_batch_tokens=40, grad_clip=0.5)
    base.update(kw)
    return TrainConfig(**base, parallel={"ranks": ranks, "strategy": strategy})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_give_the_one_process_update(strategy):
    samples = make_samples(3, groups=5, size=3)
    kw = dict(minibatches=2, ppo_epochs=1, old_logprobs="trainer")  # 2 optimiser steps: the proximal forward too
    ref = Trainer(tiny(), _cfg("none", 1, **kw))
    ref_metrics = []
    ref_grads = []
    for _ in range(3):
        ref_metrics.append(ref.train_step(samples))
        ref_grads.append({n: p.grad.clone() for n, p in ref.model.named_parameters()})
    group = RankGroup(tiny(), _cfg(strategy, 2, **kw))
    pids = group.pids
    try:
        for step in range(3):
            m = group.train_step(samples)
            assert m["loss/total"] == pytest.approx(ref_metrics[step]["loss/total"], rel=1e-5, abs=1e-6)
            assert m["train/grad_norm"] == pytest.approx(ref_metrics[step]["train/grad_norm"], rel=1e-5)
            assert m["train/packed_tokens"] < m["train/flat_tokens"]  # tree packing is on, on the ranks too
            grads = group.run(full_grads)
            assert rel_diff(grads[0], ref_grads[step]) <= 1e-5
            assert rel_diff(grads[1], ref_grads[step]) <= 1e-5
        params = group.run(full_params)
        for rank_params in params:
            assert rel_diff(rank_params, dict(ref.model.named_parameters())) <= 1e-5
        assert not torch.equal(params[0]["lm_head.weight"], dict(tiny().named_parameters())["lm_head.weight"])  # it trained
    finally:
        group.close()
    assert not alive(pids)


def test_settings_that_are_not_exact_across_ranks_are_refused():
    for kw in (dict(loss={"aggregation": "constant"}), dict(loss={"kind": "clip_cov"}), dict(lora_rank=4)):
        with pytest.raises(InvalidRequestError):
            check_supported(_cfg("fsdp2", 2, **kw))
    check_supported(_cfg("fsdp2", 2, loss={"aggregation": "constant", "constant_normalizer": 64}))
    with pytest.raises(ValueError, match="strategy=ddp or fsdp2"):
        TrainConfig(parallel={"ranks": 2})


def test_the_grad_norm_is_float64_and_clipping_scales_by_torchs_rule():
    """The reported norm is the float64 norm of the gradients (float32's drifts ~1e-5 on a large model
    and clipping scales every gradient by it); above train.grad_clip each gradient is x clip / (norm + 1e-6)."""
    samples = make_samples(7)
    raw_trainer = Trainer(tiny(), _cfg("none", 1, grad_clip=0.0))
    raw_trainer.optimizer.step = lambda: None  # keep the gradients as the step left them
    norm = raw_trainer.train_step(samples)["train/grad_norm"]
    raw = {n: p.grad.clone() for n, p in raw_trainer.model.named_parameters() if p.grad is not None}
    want = float(torch.sqrt(sum(g.double().pow(2).sum() for g in raw.values())))
    assert norm == pytest.approx(want, rel=1e-12)
    clip = norm / 4
    clipped_trainer = Trainer(tiny(), _cfg("none", 1, grad_clip=clip))
    clipped_trainer.optimizer.step = lambda: None
    assert clipped_trainer.train_step(samples)["train/grad_norm"] == norm
    for n, p in clipped_trainer.model.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, raw[n] * (clip / (norm + 1e-6))), n
