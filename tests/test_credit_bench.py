"""``arborl bench credit`` is registered and every configuration it runs is a valid config (a renamed knob
fails here, not after minutes of benchmarking); its percentile is the one it names."""

from __future__ import annotations

import pytest

from arborl_bench import BENCHMARKS, get_benchmark
from arborl_bench import credit_bench as cb
from arborl.config import load_config


def test_registered():
    assert BENCHMARKS["credit"] == "arborl_bench.credit_bench:run" and get_benchmark("credit") is cb.run


@pytest.mark.parametrize("label", sorted(cb.CREDIT))
def test_every_configuration_is_a_valid_config(label, tmp_path):
    if not cb._available(label):
        pytest.skip(f"{label}: its estimator / loss is not registered yet")
    cfg = load_config(None, [f"runs_dir={tmp_path}", *cb.BASE, *cb.CREDIT[label], "engine.weights_dtype=bfloat16",
                             "train.correction.mode=tis"])
    assert cfg.rollout.task == "chain_tokens" and cfg.rollout.max_turns == 3
    if label == "grpo_outcome":
        assert cfg.train.advantage.shaping.process_weight == 0
    else:
        assert cfg.train.advantage.shaping.process_weight == 1


def test_p99():
    assert cb._p99([]) is None
    assert cb._p99([float(i) for i in range(101)]) == 99.0
    assert cb._p99([3.0, 1.0, 2.0]) == 3.0
