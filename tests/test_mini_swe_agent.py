"""The real mini-swe-agent (PyPI, in .venv-mswea: `make mswea`, which `make test` runs) as a black-box agent
of the code-repair suite: `mini` runs inside each episode's bubblewrap sandbox with configs/mini_swe_agent.yaml,
its litellm calls reach the run's gateway and are recorded; demonstrations are rendered by mini itself in its
own action format (its DeterministicModel replaying the expert's shell commands), judged by the hidden tests,
and train through `arborl sft`'s path in one `arborl train` (tiny random model)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from arborl.config import load_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.tasks.code_repair import CodeRepairSuite

from helpers.tiny_run import ENV, arborl_cmd

REPO = Path(__file__).resolve().parents[1]
MINI = REPO / ".venv-mswea/bin/mini"
AGENT_CFG = yaml.safe_load((REPO / "examples/mini_swe_agent/config.yaml").read_text())
RENDER = ".venv-mswea/bin/python examples/mini_swe_agent/demo.py --config examples/mini_swe_agent/config.yaml"

if not MINI.exists():
    pytest.skip("mini-swe-agent is not installed in .venv-mswea: run `make mswea` (make test does)",
                allow_module_level=True)
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make sandbox)")


def _overrides(tmp_path, *extra):
    return [f"runs_dir={tmp_path}", "name=mini", "model.source=tiny", "model.tiny_tokenizer=smollm2",
            "model.tiny_layers=1", "model.tiny_hidden=32", "scheduling.timeline=false",
            f"rollout.code_repair.suite_dir={tmp_path / 'suite'}", "rollout.code_repair.per_template=2",
            "rollout.code_repair.require_validated=false", f"rollout.envs.root_dir={tmp_path / 'ws'}",
            "rollout.steps=1", "rollout.batch_tasks=1", "rollout.group_size=2", "rollout.max_tokens=12",
            "rollout.eval_tasks=1", "rollout.workers=0", "train.advantage.drop_zero_variance=false",
            "train.sft.batch_transcripts=2", "train.sft.heldout_fraction=0", *extra]


def test_demos_are_rendered_by_mini_itself_and_it_learns_through_the_gateway(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the agent command and the render program are the repository's
    demos = tmp_path / "demos.jsonl"
    r = subprocess.run(arborl_cmd("envs", "demos", "code_repair", "configs/mini_swe_agent.yaml", "--limit", "2",
                                  "--per-task", "1", "--render-command", RENDER, "--out", str(demos),
                                  *[x for o in _overrides(tmp_path) for x in ("--set", o)]),
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in demos.read_text().splitlines()]
    assert len(rows) == 2 and json.loads(r.stdout.strip().splitlines()[-1])["dropped"] == 0
    regex = re.compile(AGENT_CFG["model"]["action_regex"], re.DOTALL)
    for row in rows:
        m = row["messages"]
        assert m[0] == {"role": "system", "content": AGENT_CFG["agent"]["system_template"].strip()}
        assert [x["role"] for x in m[1:]] == ["user"] + ["assistant", "user"] * ((len(m) - 3) // 2) + ["assistant"]
        assert all(len(regex.findall(x["content"])) == 1 for x in m if x["role"] == "assistant")  # mini parses each
        assert regex.findall(m[-1]["content"]) == ["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
        assert all(x["content"].startswith("<returncode>0</returncode>") for x in m[3::2])  # real outputs
        assert row["tools"] == [] and row["passed"] == row["total"] > 0

    cfg = load_config(REPO / "configs/mini_swe_agent.yaml", _overrides(tmp_path, f"train.sft.files=[{demos}]"))
    summary = train(cfg)
    assert summary["sft_transcripts"] == 2 and summary["steps"] == 1
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(e.episode_id) for e in pool.episodes()]
    trained = [e for e in episodes if e.group_id.startswith("step")]
    assert len(trained) == 2
    suite = CodeRepairSuite(cfg.rollout.code_repair, envs=cfg.rollout.envs)
    statements = {t.id: t.statement for split in ("train", "eval", "eval_perturbed") for t in suite.pool(split)}
    for e in episodes:
        assert e.status.value == "finished", e.meta.get("outcome")
        answer = json.loads(e.meta["outcome"]["answer"])  # run.py's report of mini's trajectory
        assert answer["exit_status"] in ("Submitted", "LimitsExceeded", "RepeatedFormatError"), answer
        assert e.calls, "mini's model calls were recorded by the gateway"
        first = e.calls[0].meta["request"]["messages"]
        assert first[0]["content"] == AGENT_CFG["agent"]["system_template"].strip()  # mini's own template
        assert first[1]["content"] == statements[e.task_id].strip()  # instance_template: the task's statement
        assert "tests_passed_frac" in e.reward_components  # the hidden tests judged mini's workspace
