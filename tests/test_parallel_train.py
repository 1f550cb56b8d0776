"""`arborl train` with train.parallel: the trainer runs as 2 FSDP2 rank processes; the run trains,
checkpoints (sharded + HF), resumes, and leaves no rank process."""

from __future__ import annotations

import json
import os

import pytest

from arborl.config import load_config
from arborl.run.job import train
from arborl.train.checkpoint import has_checkpoint
from helpers.parallel import rank_children
from helpers.tiny_run import overrides


@pytest.fixture(autouse=True)
def _tag_ranks(monkeypatch):
    monkeypatch.setenv("ARBORL_TEST_OWNER", str(os.getpid()))  # the ranks inherit it: rank_children finds them


def _metrics(cfg) -> list[dict]:
    return [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_runs_on_two_fsdp2_ranks_and_resumes(tmp_path):
    par = ["train.parallel.ranks=2", "train.parallel.strategy=fsdp2", "train.packing=tree"]
    one = load_config(None, overrides(tmp_path, "one", "rollout.steps=1"))
    train(one)
    half = load_config(None, overrides(tmp_path, "par", "rollout.steps=2", *par))
    train(half)
    assert not rank_children()
    assert has_checkpoint(half.run_dir / "checkpoint") and (half.run_dir / "checkpoint" / "dcp").is_dir()
    a, b = _metrics(one), _metrics(half)
    # step 1: the same episodes (same start weights), the same update on 2 ranks as in one process
    assert a[0]["reward"] == b[0]["reward"]
    assert b[0]["train/grad_norm"] == pytest.approx(a[0]["train/grad_norm"], rel=1e-4)
    assert b[0]["loss/total"] == pytest.approx(a[0]["loss/total"], rel=1e-4, abs=1e-6)
    rest = load_config(None, overrides(tmp_path, "par", "rollout.steps=3", *par))
    train(rest, resume=True)
    assert [m["step"] for m in _metrics(rest)] == [1, 2, 3]
    assert not rank_children()


def test_an_sft_warm_start_on_ranks_is_refused_with_what_to_do():
    from arborl.config import ConfigError

    with pytest.raises(ConfigError, match="arborl sft"):
        load_config(None, ["train.parallel.ranks=2", "train.parallel.strategy=ddp", "train.sft.files=demos.jsonl"])
