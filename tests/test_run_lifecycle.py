"""A run's life as a user lives it: resume reads the run's own config (changes recorded, config.yaml
never rewritten, a model change refused in one line), a failed start writes nothing, a run without a
checkpoint restarts with --overwrite, SIGTERM saves and tells how to resume (real subprocess, real
signal), and after a kill -9 the resume marks the episodes left running as aborted."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
from pathlib import Path

import torch
import yaml
from helpers import signal_agent
from helpers.tiny_run import ENV, arborl_cmd, overrides, set_args, tiny_cfg
from rich.console import Console
from typer.testing import CliRunner

from arborl.cli import app
from arborl.config import dump_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.run_config import resume_config
from arborl.types import EpisodeStatus

STEP_LINE = r"^step (\d+)/{total}  reward [\d.]+  success [\d.]+  \d+ tok/s  step [\d.]+s  loss \S+$"


def _steps(run: Path) -> list[int]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == "step"]


def _checkpoint_step(run: Path) -> int:
    return torch.load(run / "checkpoint" / "trainer.pt", weights_only=False)["extra"]["step"]


def test_resume_reads_the_runs_own_config_and_refuses_another_model(tmp_path):
    runner = CliRunner()
    first = runner.invoke(app, ["train", *set_args(overrides(tmp_path, "r", "rollout.steps=1"))])
    assert first.exit_code == 0, first.output
    assert re.search(STEP_LINE.format(total=1), first.output, re.M), first.output  # not a terminal: plain lines
    assert "1 step x 4 tasks x 4 episodes" in first.output
    run = tmp_path / "r"
    config = (run / "config.yaml").read_bytes()

    # the run directory and the one knob that changes: model, task, lr, ... come from the run's config.yaml
    more = runner.invoke(app, ["train", "--resume", str(run), "--set", "rollout.steps=2"])
    assert more.exit_code == 0, more.output
    assert "resumed from" in more.output and "rollout.steps: 1 -> 2" in more.output
    assert _steps(run) == [1, 2] and _checkpoint_step(run) == 2
    assert (run / "config.yaml").read_bytes() == config
    (record,) = yaml.safe_load((run / "config.changes.yaml").read_text())
    assert record["at_step"] == 1 and record["changes"] == {"rollout.steps": {"from": 1, "to": 2}}

    # by name (runs_dir only because the test's runs are not under ./runs): the recorded change holds
    for by_name in (["r", "--set", f"runs_dir={tmp_path}"], ["--set", f"runs_dir={tmp_path}", "--set", "name=r"]):
        again = runner.invoke(app, ["train", "--resume", *by_name])
        assert again.exit_code == 0, again.output
        assert "has done its 2 steps" in again.output and _steps(run) == [1, 2]

    changes = (run / "config.changes.yaml").read_bytes()
    bad = runner.invoke(app, ["train", "--resume", str(run), "--set", "model.tiny_hidden=64"])
    assert bad.exit_code == 2
    (line,) = bad.output.strip().splitlines()
    assert f"cannot resume {run} with model.tiny_hidden=64: the run has model.tiny_hidden=32" in line
    assert (run / "config.yaml").read_bytes() == config and (run / "config.changes.yaml").read_bytes() == changes


def test_a_failed_start_writes_nothing_and_a_run_without_checkpoint_restarts_with_overwrite(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["train", *set_args(overrides(tmp_path, "nomodel", "model.source=hf",
                                                                "model.path=/nonexistent"))])
    assert missing.exit_code == 2 and "model.path /nonexistent is not a directory" in missing.output
    assert not (tmp_path / "nomodel").exists()

    # what a run killed before its first checkpoint leaves: its config, a logged step, its data pool
    run = tmp_path / "early"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(tiny_cfg(tmp_path, "early", "rollout.steps=1")))
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 1, "reward": 0.5}) + "\n")
    DataPool(run / "datapool.sqlite").close()
    as_file = runner.invoke(app, ["train", str(run)])
    assert as_file.exit_code == 2 and "is a directory: continue the run there with --resume" in as_file.output
    again = runner.invoke(app, ["train", *set_args(overrides(tmp_path, "early", "rollout.steps=1"))])
    assert again.exit_code == 2 and "without a checkpoint" in again.output and "--resume" in again.output
    assert "--overwrite" in again.output
    # with nothing saved, --resume starts again at step 0 (the metrics after it are cut)
    resumed = runner.invoke(app, ["train", "--resume", str(run)])
    assert resumed.exit_code == 0 and "resumed at step 0: the run stopped before saving a checkpoint" in resumed.output
    assert _steps(run) == [1] and json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["reward"] != 0.5
    fresh = runner.invoke(app, ["train", "--overwrite", *set_args(overrides(tmp_path, "early", "rollout.steps=1"))])
    assert fresh.exit_code == 0, fresh.output
    assert _steps(run) == [1] and json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["reward"] != 0.5
    assert _checkpoint_step(run) == 1



REWARDS = """
def strict(task, completion, calls, answer):  # passes the check with no calls, fails on a real episode
    if calls:
        raise ModuleNotFoundError("No module named 'suite_scorer'")
    return 0.0

def fixed(task, completion, calls, answer):
    return float(len(completion) % 2)
"""


def test_a_start_that_fails_before_its_first_step_leaves_no_run_and_the_same_command_reruns(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "eval"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n"
                                                     for i in range(4)))
    (data / "reward.py").write_text(REWARDS)
    args = overrides(tmp_path, "byo", "rollout.task=dataset", "rollout.max_turns=1", "rollout.eval_tasks=1",
                     "rollout.steps=1", f"rollout.data.train_files=[{data}/train.jsonl]",
                     f"rollout.data.eval_files=[{data}/eval.jsonl]")
    runner, run = CliRunner(), tmp_path / "byo"
    # the reward file imports what is not installed: the held-out evaluation before step 1 fails
    failed = runner.invoke(app, ["train", *set_args([*args, f"rollout.data.reward_function={data}/reward.py:strict"])])
    assert failed.exit_code == 2 and "strict raised on task data-eval-0" in failed.output, failed.output
    assert not run.exists()

    # a folder of the user's under the run's name: a failed start removes only what it wrote
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    again = runner.invoke(app, ["train", *set_args([*args, f"rollout.data.reward_function={data}/reward.py:strict"])])
    assert again.exit_code == 2 and sorted(p.name for p in run.iterdir()) == ["notes.txt"], again.output

    fixed = runner.invoke(app, ["train", *set_args([*args, f"rollout.data.reward_function={data}/reward.py:fixed"])])
    assert fixed.exit_code == 0, fixed.output
    assert _steps(run) == [1] and _checkpoint_step(run) == 1 and (run / "notes.txt").read_text() == "mine"
    assert "reward.py:fixed" in (run / "config.yaml").read_text()


EPISODES_PER_STEP = 16  # rollout.batch_tasks x rollout.group_size of the tiny job


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_finishes(tmp_path):
    run = tmp_path / "sig"
    # SIGTERM arrives as step 2's first episode ends: an event inside the step, not a race with its speed
    agent = signal_agent.install(tmp_path / "agent", "TERM", at=EPISODES_PER_STEP + 1)
    cmd = arborl_cmd("train", *set_args(overrides(tmp_path, "sig", "rollout.steps=4", agent)))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    summary = json.loads((run / "summary.json").read_text())
    done = summary["steps"]
    assert done == 2 and summary["stopped"] == "SIGTERM"
    assert _checkpoint_step(run) == done and _steps(run) == list(range(1, done + 1))
    assert "SIGTERM received: stopping after the step in flight" in out
    assert f"stopped by SIGTERM after step {done} of 4" in out
    assert f"Resume with: arborl train --resume {run}" in out and "exit status 143 = 128 + SIGTERM" in out
    assert re.findall(STEP_LINE.format(total=4), out, re.M) == [str(s) for s in range(1, done + 1)]

    res = CliRunner().invoke(app, ["train", "--resume", str(run)])  # the command it printed
    assert res.exit_code == 0, res.output
    assert f"resumed from {run / 'checkpoint'} at step {done}" in res.output
    assert _steps(run) == [1, 2, 3, 4]
    assert "stopped" not in json.loads((run / "summary.json").read_text())


def test_resume_after_kill_9_aborts_the_episodes_left_running(tmp_path):
    run = tmp_path / "k9"
    # killed as step 3's first episode ends, before it is closed: step 2's checkpoint exists, episodes are open
    agent = signal_agent.install(tmp_path / "agent", "KILL", at=2 * EPISODES_PER_STEP + 1)
    cmd = arborl_cmd("train", *set_args(overrides(tmp_path, "k9", "rollout.steps=40", "rollout.checkpoint_every=1", agent)))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        assert proc.wait(timeout=240) == -signal.SIGKILL
    finally:
        proc.kill()
    with DataPool(run / "datapool.sqlite") as pool:
        running = {e.episode_id for e in pool.episodes(status=EpisodeStatus.RUNNING, with_calls=False)}
        # members it finished but had not scored when it died count as in flight too
        unscored = {e.episode_id for e in pool.episodes(with_calls=False)
                    if e.status != EpisodeStatus.RUNNING and e.reward is None and "member" in e.meta}
    assert running  # what a dead process leaves behind
    left = running | unscored

    step = _checkpoint_step(run)
    out = io.StringIO()
    train(resume_config(run, [f"rollout.steps={step + 1}"]), resume=True, console=Console(file=out))
    assert f"marked {len(left)} episode" in out.getvalue() and "left running by the stopped process as aborted" in out.getvalue()
    assert "decoded token" in out.getvalue() and "discarded" in out.getvalue()
    with DataPool(run / "datapool.sqlite") as pool:
        assert pool.count_episodes(status=EpisodeStatus.RUNNING) == 0
        assert {pool.get_episode(e, with_calls=False).status for e in left} == {EpisodeStatus.ABORTED}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 2))
    assert rows[-1]["episodes"] == 16  # the resumed step trained its own 4 x 4 episodes, none of the stale ones
