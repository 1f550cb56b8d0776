"""Exactly once across kills: an asynchronous run (async_ratio, windowed FIFO) SIGKILLed at each named
moment -- before a step trains, between training and the weight update, after a step before its
checkpoint, in the middle of writing the checkpoint, and mid-rollout -- and resumed each time, ends with
every prompt of the stream trained once (none skipped, none twice), every episode committed before a
kill trained once (none twice, none dropped), the decoded tokens of the episodes in flight counted as
discarded, and no half-written checkpoint left behind. The kills come from the run's own progress
(``ARBORL_FAILPOINTS``, an agent that kills its process at its N-th episode), never from a timer."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import signal_agent
from helpers.tiny_run import ENV, arborl_cmd, overrides, set_args

from arborl.datapool import DataPool
from arborl.datapool.ledger import exactly_once
from arborl.failpoints import ENV as FAILPOINTS

STEPS, TASKS, GROUP = 6, 4, 4


def _run(cmd: list[str], failpoints: str | None = None) -> tuple[int, str]:
    env = {**ENV, **({FAILPOINTS: failpoints} if failpoints else {})}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300)
    return proc.returncode, proc.stdout


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]


@pytest.mark.parametrize("consume", ["async_ratio", "windowed_fifo"])
def test_an_async_run_killed_at_every_named_moment_trains_each_prompt_and_episode_once(tmp_path, consume):
    run = tmp_path / "k"
    # the agent kills its process as the run's 30th episode ends: mid-rollout, other groups in flight
    agent = signal_agent.install(tmp_path / "agent", "KILL", at=30)
    cfg = overrides(tmp_path, "k", f"rollout.steps={STEPS}", f"rollout.batch_tasks={TASKS}", f"rollout.group_size={GROUP}",
                    "rollout.checkpoint_every=1", f"scheduling.consume={consume}", "scheduling.async_ratio=1",
                    "rollout.task=chain_tokens", "rollout.max_idle_steps=0", agent)
    code, out = _run(arborl_cmd("train", *set_args(cfg)))
    assert code == -signal.SIGKILL, out
    resume = arborl_cmd("train", "--resume", str(run))
    for point in ("train@2", "publish@1", "save@2", "step_end@1"):
        code, out = _run(resume, point)
        assert code == -signal.SIGKILL, (point, out)
    code, out = _run(resume)
    assert code == 0, out
    assert _steps(run) == list(range(1, STEPS + 1))
    assert not list(run.glob(".checkpoint.*"))  # the save killed half-way left nothing behind
    with DataPool(run / "datapool.sqlite") as pool:
        counts = exactly_once(pool)
        ledger = pool.ledger()
    assert counts["kills"] == 5
    # each step took TASKS groups: trained, or (all rewards equal: no learning signal) resolved without samples
    assert counts["prompts_trained"] + counts["groups_without_samples"] == STEPS * TASKS, counts
    assert counts["prompts_skipped"] == 0 and counts["prompts_duplicated"] == 0
    assert counts["episodes_trained_twice"] == 0 and counts["episodes_dropped"] == 0
    assert counts["episodes_trained"] == counts["prompts_trained"] * GROUP
    # the mid-rollout kill left episodes in flight: their recorded calls were served again to their re-runs
    # (replayed) as far as the version bound allows, the rest discarded
    in_flight = sum(a["discarded_tokens"] for a in ledger["attempts"])
    assert in_flight > 0 and counts["decoded_tokens_discarded"] + counts["replayed_tokens"] == in_flight
    assert ledger["attempts"][0]["from_step"] == 0 and len(ledger["attempts"]) == 6
