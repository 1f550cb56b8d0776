"""Difficulty-aware dynamic sampling (issue 31; DAPO): scheduling.consume=dynamic never trains a group whose
rewards are all equal, over-draws to keep B useful groups per step, skips tasks whose recent groups were
all-pass or all-fail, and counts all of it in the step metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from arborl.config import load_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.scheduling.consume import make_consume
from arborl.scheduling.dynamic import DynamicSampling

SUITE = Path(__file__).resolve().parent / "helpers" / "difficulty_suite.py"


def _drive(policy, rewards_of, steps: int, rng: random.Random):
    """Run ``policy`` like the controller: start what it allows, finish items in random order with the
    rewards ``rewards_of(item)`` gives, train each batch; returns the batches and every item's rewards."""
    seen, batches, n = {}, [], 0
    running: list[str] = []

    def fill():
        nonlocal n
        while policy.can_start():
            gid = f"g{n}"
            n += 1
            policy.on_start(gid)
            running.append(gid)

    while len(batches) < steps:
        fill()
        b = policy.take_batch()
        if b is not None:
            batches.append(b)
            policy.on_version(policy.version + 1)
            continue
        fill()  # taking dropped finished groups: their replacements start (as the controller does)
        assert running, policy.stats()
        gid = running.pop(rng.randrange(len(running)))
        seen[gid] = rewards_of(gid)
        policy.on_rewards(gid, f"task{int(gid[1:]) % 7}", seen[gid])
        policy.on_finish(gid, policy.version)
    return batches, seen


def test_never_an_all_equal_group_and_b_groups_per_step():
    rng = random.Random(0)
    policy = DynamicSampling(4, max_draws=4.0, skip_after=0)
    rewards = lambda gid: [float(rng.random() < 0.3) for _ in range(4)]  # noqa: E731 - many all-fail groups
    batches, seen = _drive(policy, rewards, 30, rng)
    trained = [g for b in batches for g in b.items]
    assert all(len(set(seen[g])) > 1 for g in trained)  # never an all-equal group
    short = policy.counts["short_batches"]
    assert sum(len(b.items) == 4 for b in batches) == 30 - short and short <= 2  # B groups per step
    st = policy.stats()
    assert st["all_equal_groups"] == sum(len(set(r)) == 1 for r in seen.values()) > 10
    assert st["overdrawn_groups"] > 0 and st["dropped_all_equal"] == st["all_equal_groups"]


def test_the_draw_budget_bounds_a_step_and_a_short_batch_is_taken():
    policy = DynamicSampling(2, max_draws=2.0, skip_after=0)
    batches, seen = _drive(policy, lambda gid: [0.0, 0.0], 3, random.Random(1))
    assert [b.items for b in batches] == [(), (), ()] and len(seen) == 12  # 2 x B drawn per step, none trained
    assert policy.counts["short_batches"] == 3


def test_tasks_with_all_equal_history_are_skipped_then_retried():
    p = DynamicSampling(2, skip_after=2)
    for k in range(2):
        p.on_rewards(f"a{k}", "solved~1", [1.0, 1.0])
        p.on_rewards(f"b{k}", "open", [1.0, 0.0])
    assert p.pass_rates() == {"solved": 1.0, "open": 0.5}
    assert p.admit("open") and not p.admit("solved~3") and p.counts["skipped_tasks"] == 1
    assert p.admit("solved")  # its oldest group was forgotten: down-weighted, not banned
    with pytest.raises(ValueError, match="max_draws"):
        DynamicSampling(2, max_draws=0.5)


def test_dynamic_is_off_by_default_and_picked_by_name():
    cfg = load_config(None, [])
    assert cfg.scheduling.consume == "sync" and make_consume(cfg.scheduling, 4).name == "sync"
    cfg = load_config(None, ["scheduling.consume=dynamic", "scheduling.dynamic_max_draws=2",
                             "scheduling.dynamic_skip_after=0"])
    p = make_consume(cfg.scheduling, 4)
    assert p.name == "dynamic" and p.max_started == 8 and p.skip_after == 0


def test_a_training_run_with_dynamic_sampling_trains_only_groups_with_signal(tmp_path):
    cfg = load_config(None, [
        f"runs_dir={tmp_path}", "name=dyn", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1",
        "model.tiny_hidden=32", "engine.max_seq_len=512", f"rollout.task={SUITE}:suite", "rollout.max_tokens=2",
        "rollout.steps=3", "rollout.batch_tasks=2", "rollout.group_size=4", "rollout.temperature=1.0",
        "rollout.eval_tasks=0", "scheduling.consume=dynamic", "scheduling.dynamic_max_draws=4",
        "scheduling.dynamic_skip_after=1", "train.advantage.drop_zero_variance=false", "scheduling.timeline=false"])
    train(cfg)
    steps = [json.loads(x) for x in (tmp_path / "dyn" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert len(steps) == 3
    for s in steps:
        assert s["zero_variance_groups"] == 0  # never an all-equal group trained
        if s["sched/short_batches"] == 0:
            assert s["episodes"] == 8  # B = 2 groups of 4
    assert steps[-1]["sched/all_equal_groups"] > 0 and steps[-1]["sched/skipped_tasks"] > 0
    assert steps[-1]["sched/overdrawn_groups"] > 0
    # throughput counts what the rollout generated, the dropped all-equal groups too, per second of the rollout
    # (dynamic waits for its batch like sync: training is not generation time)
    with DataPool(tmp_path / "dyn" / "datapool.sqlite") as pool:
        generated = sum(len(c.completion_token_ids) for e in pool.episodes() for c in e.calls)
    assert sum(s["generated_tokens"] for s in steps) == generated
    for s in steps:
        assert s["rollout_tokens_per_s"] == pytest.approx(s["generated_tokens"] / s["rollout_s"])
