"""`arborl runs [DIR]` lists run directories with their headline figures; `arborl compare RUN RUN` sets
them side by side; bad paths exit 2 with a message that says what to give. Run directories are written
through arborl's own writers (config.yaml, MetricsLog, summary.json), as a run writes them."""

from __future__ import annotations

import json
import os

from helpers.tiny_run import tiny_cfg
from typer.testing import CliRunner

from arborl.cli import app
from arborl.config import dump_config
from arborl.report import MetricsLog


def make_run(runs_dir, name, rewards, *, finished=True, task="even_tokens"):
    cfg = tiny_cfg(runs_dir, name, f"rollout.steps={len(rewards) + 1}", f"rollout.task={task}")
    d = cfg.run_dir
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(dump_config(cfg))
    log = MetricsLog(d / "metrics.jsonl")
    log.write({"kind": "eval", "step": 0, "eval_success": 0.125})
    for i, r in enumerate(rewards):
        log.write({"kind": "step", "step": i + 1, "reward": r, "success": r / 2, "step_s": 2.0 + i,
                   "rollout_tokens_per_s": 100.0, "loss/total": 0.5 - i / 10})
    log.write({"kind": "eval", "step": len(rewards), "eval_success": 0.625})
    if finished:
        (d / "summary.json").write_text(json.dumps({"steps": len(rewards)}))
    else:  # a job that stopped long ago without a summary
        for f in d.iterdir():
            os.utime(f, (1e9, 1e9))
    return d


def run_cli(*args):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_runs_lists_run_directories_with_headline_figures(tmp_path):
    make_run(tmp_path, "alpha", [0.25, 0.5, 0.75])
    make_run(tmp_path, "beta", [0.1, 0.2], finished=False, task="arith")
    (tmp_path / "not-a-run").mkdir()
    r = run_cli("runs", str(tmp_path), "--json")
    assert r.exit_code == 0, r.output
    heads = {h["run"]: h for h in map(json.loads, r.output.splitlines())}
    assert sorted(heads) == ["alpha", "beta"]
    a, b = heads["alpha"], heads["beta"]
    assert (a["steps"], a["state"], a["reward_first"], a["reward_last"]) == ("3/4", "done", 0.25, 0.75)
    assert (a["eval_success_first"], a["eval_success_last"], a["mean_step_s"]) == (0.125, 0.625, 3.0)
    assert (b["steps"], b["state"], b["task"]) == ("2/3", "stopped", "arith")
    table = run_cli("runs", str(tmp_path)).output
    assert "alpha" in table and "0.25→0.75" in table and "0.125→0.625" in table and "not-a-run" not in table


def test_compare_prints_runs_side_by_side(tmp_path):
    a = make_run(tmp_path, "alpha", [0.25, 0.5, 0.75])
    b = make_run(tmp_path, "beta", [0.1, 0.2])
    r = run_cli("compare", str(a), str(b))
    assert r.exit_code == 0, r.output
    lines = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
             for line in r.output.splitlines() if line.count("│") == 4}
    assert lines["reward_last"] == ["0.75", "0.2"]
    assert lines["steps"] == ["3/4", "2/3"]
    assert lines["last loss/total"] == ["0.3", "0.4"]


def test_bad_paths_exit_2_with_what_to_give(tmp_path):
    a = make_run(tmp_path, "alpha", [0.5])
    r = CliRunner().invoke(app, ["compare", str(a), str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not a run directory" in r.output and "nope" in r.output
    r = CliRunner().invoke(app, ["compare", str(a)])
    assert r.exit_code == 2 and "two or more" in r.output
    r = CliRunner().invoke(app, ["runs", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output
