"""The harbor task suite: Harbor task folders read, refused where they need a container image (with the
reason), built into real bubblewrap workspaces at their workdir, verified by their own tests/test.sh at
/tests with the reward read from /logs/verifier, validated and turned into demonstrations, and trained
end to end through `arborl train` (tiny model)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from arborl.config import EnvsConfig, HarborConfig
from arborl.datapool import DataPool
from arborl.envs.base import EnvError
from arborl.envs.local import LocalRuntime
from arborl.run.job import train
from arborl.tasks.harbor import HarborSuite, read_task
from arborl.tasks.harbor.suite import run_noop, run_solution
from arborl.tasks.harbor.task_folder import dockerfile_lines

from helpers.tiny_run import ENV, arborl_cmd, tiny_cfg

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "examples/harbor_tasks"
HOST = HarborConfig().host_images


def _task(root: Path, name: str, dockerfile: str | None, *, toml: str = "", test: str = "echo 1 > /logs/verifier/reward.txt",
          files: dict[str, str] | None = None, solve: str = "true") -> Path:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text(f'version = "1.0"\n{toml}\n')
    (d / "instruction.md").write_text(f"Do {name}.\n")
    if dockerfile is not None:
        (d / "environment/Dockerfile").write_text(dockerfile)
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    (d / "tests/test.sh").write_text(f"mkdir -p /logs/verifier\n{test}\n")
    (d / "solution/solve.sh").write_text(solve)
    return d


@pytest.mark.parametrize("dockerfile, toml, reason", [
    ("FROM python:3.12\nRUN pip install requests\n", "", "line 2: RUN pip install requests changes the image"),
    ("FROM node:20\nWORKDIR /app\n", "", "line 1: FROM node:20 is not one of rollout.harbor.host_images"),
    ("FROM python:3.12\nCOPY a.txt /etc/a.txt\n", "", "line 2: COPY to /etc/a.txt writes outside the workdir /app"),
    ("FROM python:3.12\nCOPY --from=builder /x /app/x\n", "", "COPY --from copies out of another image"),
    ("FROM python:3.12\nADD https://example.com/x.tgz /app/\n", "", "downloads: the sandbox has no network"),
    (None, '[environment]\ndocker_image = "ghcr.io/org/env:1"', "docker_image = 'ghcr.io/org/env:1' is a prebuilt image"),
])
def test_a_task_that_needs_a_container_image_is_refused_with_its_reason(tmp_path, dockerfile, toml, reason):
    t = read_task(_task(tmp_path, "t", dockerfile, toml=toml, files={"a.txt": "x"}), HOST)
    assert t.refusal is not None and reason in t.refusal


def test_compose_services_are_refused_and_a_refused_task_is_never_drawn(tmp_path):
    _task(tmp_path, "svc", "FROM python:3.12\n")
    (tmp_path / "svc/environment/docker-compose.yaml").write_text("services: {db: {image: postgres}}\n")
    _task(tmp_path, "ok", "FROM python:3.12-slim\nWORKDIR /app\n", toml='[metadata]\nsplit = "train"')
    suite = HarborSuite(HarborConfig(tasks_dir=str(tmp_path)), envs=EnvsConfig(root_dir=str(tmp_path / "ws")))
    assert "docker-compose.yaml starts services" in suite.refused["svc"]
    assert {t.metadata["harbor_task"] for t in suite.tasks("train", 5)} == {"ok"}
    with pytest.raises(EnvError, match="no runnable Harbor tasks for split 'eval'.*refused: svc"):
        suite.tasks("eval", 1)


def test_the_dockerfile_subset_builds_the_workspace(tmp_path):
    df = ("# build\nFROM python:3.12-slim AS base\nWORKDIR /srv\nWORKDIR app\nENV A=1 B=\"two words\"\nENV C three four\n"
          "RUN mkdir -p data/in && mkdir logs\nCOPY src/ ./\nCOPY ['notes.txt', 'more.txt', 'docs/']\n"
          "COPY top.txt \\\n     /srv/app/renamed.txt\nCMD [\"python\", \"main.py\"]\n").replace("'", '"')
    t = read_task(_task(tmp_path, "build", df, files={"src/main.py": "print(1)\n", "src/pkg/m.py": "",
                                                       "notes.txt": "n", "more.txt": "m", "top.txt": "t"}), HOST)
    assert t.refusal is None and t.workdir == "/srv/app"
    assert t.env == {"A": "1", "B": "two words", "C": "three four"}
    from arborl.tasks.harbor.task_folder import build_template

    out = build_template(t, tmp_path / "tpl")
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert files == ["data", "data/in", "docs", "docs/more.txt", "docs/notes.txt", "logs", "main.py", "pkg",
                     "pkg/m.py", "renamed.txt"]
    assert [w for _, w, _ in dockerfile_lines(df)][-2:] == ["COPY", "CMD"]


def test_the_verifier_runs_at_tests_and_reads_reward_files(tmp_path):
    _task(tmp_path, "json", "FROM python:3.12\nWORKDIR /srv/work\nENV GREETING=hi\nCOPY f.txt .\n", files={"f.txt": "data"},
          toml='[metadata]\nsplit = "train"',
          test='test "$PWD" = /srv/work && test -x /tests/test.sh -o -f /tests/test.sh && test "$GREETING" = hi && '
               'python -c "import json; json.dump({\'reward\': 0.5, \'style\': 1, \'ok\': True}, '
               'open(\'/logs/verifier/reward.json\', \'w\'))"; echo noise',
          solve="echo done > out.txt")
    _task(tmp_path, "none", "FROM python:3.12\n", toml='[metadata]\nsplit = "eval"', test="echo no reward file")
    suite = HarborSuite(HarborConfig(tasks_dir=str(tmp_path)), envs=EnvsConfig(root_dir=str(tmp_path / "ws")))
    v = asyncio.run(run_solution(suite, suite.by_name["json"], episode_id="t-json"))
    assert (v.reward, v.components, v.error) == (0.5, {"style": 1.0}, None), v.output  # booleans are not rewards
    v = asyncio.run(run_noop(suite, suite.by_name["none"], episode_id="t-none"))
    assert v.reward == 0.0 and "wrote neither" in v.error


def test_a_workdir_that_would_hide_the_bound_python_is_refused(tmp_path):
    import sys

    hidden = str(Path(sys.prefix).parent)  # the venv's folder: the sandbox binds the running Python from there
    _task(tmp_path, "shadow", f"FROM python:3.12\nWORKDIR {hidden}\n", toml='[metadata]\nsplit = "train"')
    suite = HarborSuite(HarborConfig(tasks_dir=str(tmp_path)), envs=EnvsConfig(root_dir=str(tmp_path / "ws")))
    with pytest.raises(EnvError, match=f"would hide {sys.prefix}"):
        asyncio.run(run_noop(suite, suite.by_name["shadow"], episode_id="t-shadow"))


def test_the_local_runtime_refuses_to_remap_paths(tmp_path):
    with pytest.raises(EnvError, match="use rollout.envs.runtime=bwrap"):
        HarborSuite(HarborConfig(tasks_dir=str(TASKS)), envs=EnvsConfig(runtime="local"))
    suite = HarborSuite(HarborConfig(tasks_dir=str(TASKS)), envs=EnvsConfig(runtime="local", root_dir=str(tmp_path / "r")),
                        runtime_factory=LocalRuntime)
    with pytest.raises(EnvError, match="cannot show a directory at /tests"):
        asyncio.run(run_noop(suite, suite.by_name["hello-file"], episode_id="t-local"))


def test_every_shipped_task_validates_from_the_command_line(tmp_path):
    r = subprocess.run(arborl_cmd("envs", "validate", "harbor", str(REPO / "configs/harbor.yaml"), "--set",
                                  f"rollout.envs.root_dir={tmp_path / 'ws'}"),
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tasks"] == out["validated"] == 6
    assert all(x["gold"] == [1.0, 1.0] and x["noop"] == [0.0, 0.0] for x in out["results"])


def test_solutions_become_demonstrations_through_the_code_agents_tool(tmp_path):
    out = tmp_path / "demos.jsonl"
    r = subprocess.run(arborl_cmd("envs", "demos", "harbor", "--tasks-dir", str(TASKS), "--out", str(out), "--set",
                                  f"rollout.envs.root_dir={tmp_path / 'ws'}"),
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    demos = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(d["task_id"] for d in demos) == ["harbor-count-lines", "harbor-fix-add", "harbor-hello-file",
                                                   "harbor-json-flag"]  # the train split only
    for d in demos:
        call = d["messages"][2]["tool_calls"][0]["function"]
        assert call["name"] == "run_command" and d["reward"] == 1.0
        assert d["messages"][3]["role"] == "tool" and d["messages"][-1]["role"] == "assistant"
        assert {t["function"]["name"] for t in d["tools"]} >= {"run_command", "read_file"}


def test_harbor_trains_end_to_end_with_its_verifier_as_the_reward(tmp_path):
    cfg = tiny_cfg(tmp_path, "harbor", "rollout.task=harbor", f"rollout.harbor.tasks_dir={TASKS}",
                   "rollout.steps=1", "rollout.batch_tasks=2", "rollout.group_size=2", "rollout.max_turns=2",
                   "rollout.eval_tasks=2", "rollout.max_tokens=8", "engine.max_seq_len=2048",
                   f"rollout.envs.root_dir={tmp_path / 'ws'}")
    summary = train(cfg)
    assert summary["steps"] == 1
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(e.episode_id) for e in pool.episodes()]
    trained = [e for e in episodes if e.group_id.startswith("step")]
    evaluated = [e for e in episodes if e.group_id.startswith("eval")]
    assert len(trained) == 4 and {e.task_id for e in evaluated} == {"harbor-fix-mul", "harbor-greet-file"}
    for e in episodes:
        verdict = e.meta["outcome"]["info"]["harbor"]
        assert verdict["error"] is None and verdict["returncode"] == 0, verdict  # the verifier ran and wrote a reward
        assert e.reward_components["outcome"] == verdict["reward"] == 0.0  # a random tiny model solves nothing
    root = Path(cfg.rollout.envs.root_dir)
    assert not list(root.glob("*.eval-*")) and not list(root.glob("ep-*"))  # no workspace or verifier scratch left


def test_eval_fraction_host_images_and_the_verifier_time_limit_do_what_they_say(tmp_path):
    for i in range(6):
        _task(tmp_path, f"t{i}", "FROM node:20\n" if i == 0 else "FROM python:3.12\n",
              test="sleep 5; echo 1 > /logs/verifier/reward.txt" if i == 1 else "echo 0 > /logs/verifier/reward.txt")

    def suite(**kw):
        return HarborSuite(HarborConfig(tasks_dir=str(tmp_path), **kw), envs=EnvsConfig(root_dir=str(tmp_path / "ws")))

    assert "t0" in suite().refused and "t0" not in suite(host_images=["python", "node"]).refused
    every = {f"t{i}" for i in range(1, 6)}
    assert {t.name for t in suite(eval_fraction=0.0).pool("train")} == every
    assert {t.name for t in suite(eval_fraction=1.0).pool("eval")} == every
    half = suite(eval_fraction=0.5)
    assert 0 < len(half.pool("train")) < 5 and {t.name for t in half.pool("train") + half.pool("eval")} == every
    quick = suite(verifier_timeout_s=1.0)
    v = asyncio.run(run_noop(quick, quick.by_name["t1"], episode_id="t-slow"))
    assert v.timed_out and v.reward == 0.0 and "time limit" in v.error
