"""Paths in a config file are that file's folder's, `--set` paths the working directory's, and both are
absolute once loaded (every error names the resolved path); `--set` gives a list knob one item as it is;
`arborl train` reads the data and tries the reward before the model loads."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from arborl.cli import app
from arborl.config import ConfigError, known_keys, load_config
from arborl.config_paths import PATH_KNOBS
from arborl.extensions import REGISTRY_KNOBS

CONFIG = """\
name: byo
runs_dir: runs
model: {source: hf, path: no-model}   # the file's folder's: task/no-model, which does not exist
rollout:
  task: dataset
  eval_tasks: 1
  data:
    train_files: [train.jsonl]
    eval_files: [eval.jsonl]
    reward_function: reward.py:score
"""

REWARD = '''
def score(task, completion, calls, answer):
    return float(completion.strip() == answer)

def boom(task, completion, calls, answer):
    raise RuntimeError("the suite's own scorer is not installed")
'''


@pytest.fixture
def task(tmp_path, monkeypatch):
    """A config kept beside its data and reward (task/), run from another folder (elsewhere/)."""
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "config.yaml").write_text(CONFIG)
    for name in ("train.jsonl", "eval.jsonl"):
        (folder / name).write_text("".join(json.dumps({"prompt": f"{i}?", "answer": str(i), "source": "x"}) + "\n"
                                           for i in range(3)))
    (folder / "reward.py").write_text(textwrap.dedent(REWARD))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return folder


def test_a_config_files_paths_are_its_folders_and_set_paths_the_working_directorys(task):
    cfg = load_config(task / "config.yaml")
    d = cfg.rollout.data
    assert d.train_files == [str(task / "train.jsonl")] and d.eval_files == [str(task / "eval.jsonl")]
    assert d.reward_function == f"{task}/reward.py:score"
    assert cfg.model.path == str(task / "no-model") and cfg.run_dir == task / "runs" / "byo"

    here = Path.cwd()
    with pytest.raises(ConfigError, match=f"config file {here.parent}/task/missing.yaml does not exist"):
        load_config("../task/missing.yaml")
    cfg = load_config(task / "config.yaml", ["rollout.data.train_files=[mine.jsonl]", "model.path=../m",
                                             "rollout.data.reward_function=r.py:f", "runs_dir=out"])
    assert cfg.rollout.data.train_files == [str(here / "mine.jsonl")]
    assert cfg.model.path == str(here.parent / "m")  # normalised
    assert cfg.rollout.data.reward_function == f"{here}/r.py:f" and cfg.runs_dir == str(here / "out")

    # names, modules, ~ and absolute paths stay; an executable is a path only with a /
    (task / "other.yaml").write_text(textwrap.dedent("""\
        model: {cache_dir: ~/models}
        engine: {vllm: {python: .venv-vllm/bin/python}, sglang: {python: python3}}
        train: {loss: {kind: my_pkg.losses:clipped}}
        rollout: {task: arith, envs: {ro_binds: [/opt/tools, scripts]}, agent_command: [python, agent.py]}
        report: {loggers: [jsonl, loggers.py:Mine]}
        """))
    cfg = load_config(task / "other.yaml")
    assert cfg.model.cache_dir == "~/models" and cfg.rollout.task == "arith"
    assert cfg.engine.vllm.python == str(task / ".venv-vllm/bin/python") and cfg.engine.sglang.python == "python3"
    assert cfg.train.loss.kind == "my_pkg.losses:clipped"
    assert cfg.rollout.envs.ro_binds == ["/opt/tools", str(task / "scripts")]
    assert cfg.rollout.agent_command == ["python", "agent.py"]  # an argv, run from the working directory
    assert cfg.report.loggers == ["jsonl", f"{task}/loggers.py:Mine"]


def test_every_path_knob_is_listed():
    keys = set(known_keys())
    assert set(PATH_KNOBS) <= keys
    assert {k for k, kind in PATH_KNOBS.items() if kind == "ref"} >= set(REGISTRY_KNOBS)
    named_like_a_path = {k for k in keys if k.rsplit(".", 1)[-1].endswith(("path", "_dir", "_files", "python", "binds"))}
    not_paths = {"rollout.envs.workspace_path", "rollout.envs.bind_python"}  # inside the sandbox; a bool
    assert named_like_a_path - not_paths <= set(PATH_KNOBS)


def test_set_gives_a_list_knob_one_item_as_it_is():
    cfg = load_config(None, ["rollout.data.train_files=a.jsonl", "rollout.agent_command=my-agent",
                             "report.loggers=jsonl,tensorboard", "sim.policies=sync/pinned"])
    assert cfg.rollout.data.train_files == [str(Path.cwd() / "a.jsonl")]
    assert cfg.rollout.agent_command == ["my-agent"]
    assert cfg.report.loggers == ["jsonl", "tensorboard"] and cfg.sim.policies == ["sync/pinned"]
    two = load_config(None, ["rollout.data.eval_files=[a.jsonl, /data/b.jsonl]"]).rollout.data.eval_files
    assert two == [str(Path.cwd() / "a.jsonl"), "/data/b.jsonl"]
    with pytest.raises(ConfigError, match=r"rollout\.max_turns: .*integer"):  # a scalar knob is still checked
        load_config(None, ["rollout.max_turns=[1]"])
    assert load_config(None, ["report.loggers=", "rollout.data.eval_files="]).report.loggers == []


@pytest.mark.parametrize("change, error", [
    ([], "model.path {task}/no-model is not a directory"),  # the data and reward are fine: the model is next
    (["rollout.data.train_files=gone.jsonl"], "rollout.data.train_files: {here}/gone.jsonl does not exist"),
    ([], "rollout.data.eval_files: {task}/typo.jsonl does not exist"),
    (["rollout.data.reward_function={task}/reward.py:boom"],
     "reward function {task}/reward.py:boom raised on task data-train-0: RuntimeError(\"the suite's own scorer"),
    (["rollout.data.eval_sample=stratified", "rollout.data.eval_stratify_key=origin"],
     "rollout.data.eval_stratify_key: 3 of 3 rows of {task}/eval.jsonl have no column 'origin'"),
], ids=["model", "set-path", "file-path", "reward", "strata"])
def test_data_and_reward_are_checked_before_the_model_loads_and_errors_name_the_resolved_path(task, change, error):
    config = task / "config.yaml"
    if "typo" in error:
        config.write_text(CONFIG.replace("eval_files: [eval.jsonl]", "eval_files: [typo.jsonl]"))
    fill = dict(task=task, here=Path.cwd())
    res = CliRunner().invoke(app, ["train", str(config), *[x for c in change for x in ("--set", c.format(**fill))]])
    assert res.exit_code == 2, res.output
    assert error.format(**fill) in res.output
    if "model.path" not in error:
        assert "model.path" not in res.output  # the model was never loaded: its error would have come first
    assert not (task / "runs").exists()
