"""Features that are unit-tested as functions, on in a real ``arborl train`` run (tiny model, gateway,
data pool, trainer): a mismatch correction (S3), the version-gap filter under async consumption (S4)
and the completion-time reward (C2), each shown by what it changes in the run's metrics or data pool."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers.tiny_run import tiny_cfg

from arborl.datapool import DataPool
from arborl.run.job import train


def _steps(cfg) -> list[dict]:
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    return [s for s in map(json.loads, lines) if s["kind"] == "step"]


def test_tis_on_weights_every_token_of_a_real_step(tmp_path):
    """The same first step (same seed, same rollouts) without and with TIS capped at 0.5: the trainer's
    ratios are ~1 (its log-probs match the engine's), so TIS weighs every loss token 0.5 and the
    step's gradient is exactly half the uncorrected one."""
    plain = tiny_cfg(tmp_path, "plain", "rollout.steps=1")
    tis = tiny_cfg(tmp_path, "tis", "rollout.steps=1", "train.correction.mode=tis", "train.correction.tis_cap=0.5")
    train(plain)
    train(tis)
    (a,), (b,) = _steps(plain), _steps(tis)
    assert a["reward"] == b["reward"] and a["mismatch/tokens"] == b["mismatch/tokens"] > 0
    assert abs(b["mismatch/ratio_mean"] - 1) < 1e-3  # trainer and engine agree: the cap is what binds
    assert (a["mismatch/weight_mean"], a["mismatch/truncated_frac"]) == (1.0, 0.0)
    assert (b["mismatch/weight_mean"], b["mismatch/truncated_frac"]) == (0.5, 1.0)
    assert b["train/grad_norm"] == pytest.approx(0.5 * a["train/grad_norm"], rel=1e-4)
    # sync consumption: the engine is idle while the step trains, its prefix cache and spare KV rows freed
    assert a["memory/engine_released_gb"] > 0


def test_max_version_gap_drops_stale_groups_under_async_consumption(tmp_path):
    """async_ratio with α = 2 starts groups two batches ahead, so some finish with tokens of an older
    policy: without the filter they are trained (a version gap of 1 or more), with max_version_gap=0
    they are dropped, every trained episode's tokens come from the trainer's own version, and the
    dropped groups' episodes stay in the data pool."""
    common = ("scheduling.consume=async_ratio", "scheduling.async_ratio=2", "rollout.batch_tasks=3", "rollout.steps=3")
    loose = tiny_cfg(tmp_path, "loose", *common)
    strict = tiny_cfg(tmp_path, "strict", *common, "scheduling.max_version_gap=0")
    train(loose)
    train(strict)
    loose_steps, strict_steps = _steps(loose), _steps(strict)
    assert max(s["sched/max_version_gap"] for s in loose_steps) >= 1
    assert sum(s["sched/dropped_groups"] for s in loose_steps) == 0
    assert [s["sched/max_version_gap"] for s in strict_steps] == [0, 0, 0]
    dropped = sum(s["sched/dropped_groups"] for s in strict_steps)
    assert dropped > 0 and [s["policy_version"] for s in strict_steps] == [1, 2, 3]
    with DataPool(strict.run_dir / "datapool.sqlite") as pool:
        groups = {e.group_id for e in pool.episodes()}
    assert len(groups) >= 3 * 3 + dropped  # every trained and every dropped group was generated and kept


TURNS_TASK = '''
from arborl.agents import AgentOutcome
from arborl.types import Task


class Turns:
    """Every episode succeeds (outcome 1); it takes one to three model calls: it stops at the first
    reply whose first token id is even. Only the completion-time reward can tell members apart."""

    name = "turns"

    def tasks(self, split, n, seed=0):
        return [Task(task_id=f"t-{split}-{seed}-{i}", prompt=f"Count ({i}).", split=split) for i in range(n)]

    def agent(self, sampling):
        async def loop(task, client):
            messages = [{"role": "user", "content": task.prompt}]
            for _ in range(3):
                reply = await client.chat(messages, **sampling)
                if reply.token_ids[0] % 2 == 0:
                    break
                messages += [reply.message, {"role": "user", "content": "Go on."}]
            return AgentOutcome(answer=reply.content)
        return loop

    def score(self, task, outcome, calls):
        return {"outcome": 1.0}


def make_suite(rollout):
    return Turns()
'''


def test_completion_time_reward_trains_groups_whose_outcomes_tie(tmp_path):
    """Every outcome is 1, so without shaping every group has zero variance and nothing trains; with
    speed_weight on (speed counted in model calls), members that finished in fewer calls get a higher
    reward than the others of their group, so the same groups train, and only where calls differ."""
    (tmp_path / "turns.py").write_text(textwrap.dedent(TURNS_TASK))
    common = (f"rollout.task={tmp_path}/turns.py:make_suite", "rollout.steps=2", "rollout.max_idle_steps=0",
              "rollout.max_tokens=4")
    off = tiny_cfg(tmp_path, "unshaped", *common)
    on = tiny_cfg(tmp_path, "shaped", *common, "train.advantage.shaping.speed_weight=0.5",
                  "train.advantage.shaping.speed_metric=turns")
    train(off)
    train(on)
    off_steps, on_steps = _steps(off), _steps(on)
    assert [s["samples"] for s in off_steps] == [0, 0]
    assert all(s["zero_variance_groups"] == 4 for s in off_steps)
    with DataPool(on.run_dir / "datapool.sqlite") as pool:
        turns: dict[str, set[int]] = {}
        for e in pool.episodes(with_calls=True):
            if e.group_id.startswith("step"):
                turns.setdefault(e.group_id, set()).add(len(e.calls))
    varied = {g for g, t in turns.items() if len(t) > 1}  # groups whose members took different numbers of calls
    assert varied, turns
    assert sum(s["zero_variance_groups"] for s in on_steps) == len(turns) - len(varied)
    assert sum(s["samples"] for s in on_steps) > 0 and on_steps[-1]["policy_version"] > 0
    assert all(s["reward"] == 1.0 for s in on_steps)  # the recorded outcome is unchanged; only training moved
