"""A step that trains nothing (every group's rewards equal) is a loud warning with the reason and what to
change; rollout.max_idle_steps such steps in a row stop the run with an explanation and a checkpoint;
a group of one episode under a group-relative advantage is refused before anything runs."""

from __future__ import annotations

import io
import json
import textwrap

import pytest
import torch
from helpers.tiny_run import tiny_cfg
from rich.console import Console

from arborl.config import ConfigError, load_config
from arborl.run.job import IdleRunError, train

CONSTANT_TASK = '''
from arborl.agents import ReActAgent
from arborl.types import Task


class Constant:
    """Every episode scores 1: no group ever has a reward to prefer."""

    name = "constant"

    def tasks(self, split, n, seed=0):
        return [Task(task_id=f"c-{split}-{seed}-{i}", prompt="Say hi.", split=split) for i in range(n)]

    def agent(self, sampling):
        return ReActAgent([], max_turns=1, **sampling)

    def score(self, task, outcome, calls):
        return {"outcome": 1.0}


def make_suite(rollout):
    return Constant()
'''


def _run(tmp_path, name, *extra):
    """(config, console output, the error the run stopped with or None)."""
    (tmp_path / "constant.py").write_text(textwrap.dedent(CONSTANT_TASK))
    cfg = tiny_cfg(tmp_path, name, f"rollout.task={tmp_path}/constant.py:make_suite", "rollout.batch_tasks=2",
                   "rollout.max_tokens=4", *extra)
    out = io.StringIO()
    try:
        train(cfg, console=Console(file=out, width=100))
    except IdleRunError as e:
        return cfg, out.getvalue(), e
    return cfg, out.getvalue(), None


def _warnings(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("warning: step")]


def test_idle_steps_warn_and_stop_the_run_with_a_checkpoint(tmp_path):
    cfg, out, error = _run(tmp_path, "stops", "rollout.steps=4", "rollout.max_idle_steps=2")
    first, second = _warnings(out)  # one line each, however long
    assert first.startswith("warning: step 1 trained nothing: 2 of 2 groups had the same reward for every episode "
                            "(mean reward 1.00), so every advantage was 0. To fix: make rewards differ within a group")
    assert first.endswith("; 1 more such step in a row stop the run (rollout.max_idle_steps=2)")
    assert second.startswith("warning: step 2 trained nothing") and "stop the run" not in second
    assert isinstance(error, IdleRunError)
    msg = str(error)
    assert "stopped after 2 steps in a row that trained nothing (steps 1-2)" in msg
    assert "raise rollout.group_size or rollout.temperature" in msg and "rollout.max_idle_steps=0" in msg
    assert f"arborl train --resume {cfg.run_dir} --set rollout.temperature=1.0" in msg
    steps = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["samples"] == 0 for s in steps)
    assert torch.load(cfg.run_dir / "checkpoint" / "trainer.pt", weights_only=False)["extra"]["step"] == 2
    assert json.loads((cfg.run_dir / "summary.json").read_text())["stopped"] == "idle"


def test_max_idle_steps_zero_only_warns(tmp_path):
    cfg, out, error = _run(tmp_path, "warns", "rollout.steps=3", "rollout.max_idle_steps=0")
    assert error is None and len(_warnings(out)) == 3 and "stop the run" not in out
    assert json.loads((cfg.run_dir / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("estimator", ["grpo", "reward_to_go"])
def test_a_group_of_one_is_refused_for_group_relative_advantages(estimator):
    with pytest.raises(ConfigError, match=r"rollout\.group_size=1: the .* advantage is a reward minus its group's mean"):
        load_config(None, ["rollout.group_size=1", f"train.advantage.estimator={estimator}"])
    # an estimator of the user's own may work on single episodes
    assert load_config(None, ["rollout.group_size=1", "train.advantage.estimator=my_pkg.adv:estimate"]).rollout.group_size == 1
