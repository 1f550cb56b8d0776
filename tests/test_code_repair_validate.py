"""E3 in the real sandbox: gold passes and the no-op fails on a task of every template; a gold patch that
fails, tests a no-op passes and flaky tests are dropped; verdicts are cached per task hash. Also the
`arborl envs validate` command. About 60 s on 2 CPU cores (the per-template sample is marked slow)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from arborl_bench.envs_tasks_bench import one_per_template
from arborl.cli import app
from arborl.config import EnvsConfig
from arborl.envs import make_runtime
from arborl.tasks.code_repair import (
    BUG_TEMPLATES,
    ValidationCache,
    load_task,
    make_task,
    materialise,
    validate_tasks,
    write_task,
)

FLAKY_TESTS = "import random\n\n\n" + "".join(f"def test_coin_{i}():\n    assert random.random() < 0.5\n\n\n" for i in range(16))


@pytest.fixture
def runtime(tmp_path):
    return make_runtime(EnvsConfig(root_dir=str(tmp_path / "envs")))


def broken(root: Path, kind: str):
    """A task whose gold patch fails, whose tests the no-op passes, or whose tests are flaky."""
    tf = make_task("wrong_return_value", 0, 0, "easy")
    d = write_task(tf, root / kind)
    bug_file = tf.meta["bug_file"]
    if kind == "gold_fails":
        (d / "gold" / bug_file).write_text(tf.repo[bug_file])  # the "fix" is the bug
    elif kind == "noop_passes":
        (d / "repo" / bug_file).write_text(tf.gold[bug_file])  # nothing to fix
    elif kind == "flaky":
        (d / "tests" / "test_hidden.py").write_text(FLAKY_TESTS)
        rec = json.loads((d / "task.json").read_text())
        rec["tests"] = [f"test_coin_{i}" for i in range(16)]
        (d / "task.json").write_text(json.dumps(rec))
    rec = json.loads((d / "task.json").read_text())
    rec.update(id=f"broken-{kind}", hash=hashlib.sha256(kind.encode()).hexdigest())  # its content differs
    (d / "task.json").write_text(json.dumps(rec))
    return load_task(d)


@pytest.mark.slow
def test_gold_passes_and_noop_fails_on_a_task_of_every_template(tmp_path, runtime):
    tasks = materialise(tmp_path / "suite", 0, 3)
    sample = one_per_template(tasks)
    assert len(sample) == len(BUG_TEMPLATES.names()) and {t.tier for t in sample} == {"easy", "medium", "hard"}
    report = asyncio.run(validate_tasks(runtime, sample, k=1, jobs=2))
    assert report.counts()["validated_tasks"] == len(sample), report.dropped()
    for t in sample:
        r = report.results[t.id]
        assert all(v == "passed" for v in r.gold[0].values())
        failing = [n for n, v in r.noop[0].items() if v != "passed"]
        assert failing == t.meta["failing_tests"]  # the sandbox agrees with the generator's own check


def test_validation_drops_broken_tasks_and_caches_verdicts(tmp_path, runtime):
    good = load_task(write_task(make_task("wrong_return_value", 0, 1, "medium"), tmp_path / "good"))
    tasks = [good] + [broken(tmp_path, k) for k in ("gold_fails", "noop_passes", "flaky")]
    cache = ValidationCache(tmp_path / "cache")
    report = asyncio.run(validate_tasks(runtime, tasks, k=2, jobs=2, cache=cache))
    assert report.counts() == {"validated_tasks": 1, "dropped_gold_fails": 1, "dropped_noop_passes": 1,
                               "dropped_flaky": 1, "infra_errors": 0}
    assert report.dropped()["gold_fails"] == ["broken-gold_fails"]
    assert report.dropped()["noop_passes"] == ["broken-noop_passes"]
    assert report.dropped()["flaky"] == ["broken-flaky"]
    assert len(report.results[good.id].gold) == 2 and len(report.results[good.id].noop) == 2

    # cached per task hash: a second run never touches the runtime, and a cache made with fewer runs is redone
    assert cache.statuses()[good.hash] == "validated"
    again = asyncio.run(validate_tasks(object(), tasks, k=2, cache=cache))  # type: ignore[arg-type]
    assert again.counts() == report.counts()
    with pytest.raises(AttributeError):  # k=3 > the cached 2: validated again, with the runtime
        asyncio.run(validate_tasks(object(), tasks[:1], k=3, cache=cache))  # type: ignore[arg-type]


def test_a_hidden_test_run_past_the_timeout_counts_as_failed(tmp_path, runtime):
    t = broken(tmp_path, "noop_passes")
    (t.tests_dir / "test_hidden.py").write_text("import time\n\n\ndef test_slow():\n    time.sleep(30)\n")
    t.tests = ["test_slow"]
    report = asyncio.run(validate_tasks(runtime, [t], k=1, timeout_s=2.0))
    r = report.results[t.id]
    assert r.gold == [{"test_slow": "missing"}] and r.status == "gold_fails"


def test_envs_validate_command(tmp_path):
    suite_dir = tmp_path / "suite"
    args = ["envs", "validate", "code_repair", "--tier", "easy", "--limit", "2", "--jobs", "2",
            "--set", f"rollout.code_repair.suite_dir={suite_dir}", "--set", "rollout.code_repair.per_template=2",
            "--set", "rollout.code_repair.validation_k=2", "--set", f"rollout.envs.root_dir={tmp_path / 'envs'}"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["validated_tasks"] == 2 and out["tasks"] == 2 and out["k"] == 2  # k from rollout.code_repair.validation_k
    cached = json.loads((suite_dir / "validation.json").read_text())
    assert len(cached) == 2 and {r["k"] for r in cached.values()} == {2}
    # --split eval: only the held-out tasks (what the code-repair job evaluates on)
    res = CliRunner().invoke(app, [*args[:3], "--tier", "easy", "--split", "eval", "--jobs", "2", *args[9:]])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    splits = {json.loads((suite_dir / "tasks" / h / "task.json").read_text())["split"]
              for h in json.loads((suite_dir / "validation.json").read_text())}
    assert out["split"] == "eval" and out["tasks"] >= 1 and splits == {"train", "eval"}
    evals = [h for h in json.loads((suite_dir / "index.json").read_text())["tasks"]
             if json.loads((suite_dir / "tasks" / h / "task.json").read_text())["split"] == "eval"
             and json.loads((suite_dir / "tasks" / h / "task.json").read_text())["tier"] == "easy"]
    assert out["tasks"] == len(evals)
    bad = CliRunner().invoke(app, [*args[:3], "--split", "test", *args[9:]])
    assert bad.exit_code == 2 and "--split must be train, eval or all" in bad.output

    bad = CliRunner().invoke(app, ["envs", "validate", "calculator"])
    assert bad.exit_code == 2 and "suite 'calculator' has no validation" in bad.output
    bad = CliRunner().invoke(app, ["envs", "validate", "code_repair", "--tier", "expert",
                                   "--set", f"rollout.code_repair.suite_dir={suite_dir}",
                                   "--set", "rollout.code_repair.per_template=2"])
    assert bad.exit_code == 2 and "--tier must be easy, medium, hard or all" in bad.output
    shutil.rmtree(tmp_path / "envs", ignore_errors=True)


def test_envs_perturb_command_makes_and_validates_variants(tmp_path):
    suite_dir = tmp_path / "suite"
    common = ["--set", f"rollout.code_repair.suite_dir={suite_dir}", "--set", "rollout.code_repair.per_template=1"]
    res = CliRunner().invoke(app, ["envs", "perturb", *common])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    n = len(BUG_TEMPLATES.names())
    assert out["tasks_base"] == n and out["tasks_rename"] == n and out["tasks_nodep"] == n
    assert out["tasks"] == sum(v for k, v in out.items() if k.startswith("tasks_"))
    res = CliRunner().invoke(app, ["envs", "perturb", "--validate", "--limit", "3", *common,
                                   "--set", "rollout.code_repair.validation_k=1", "--set", f"rollout.envs.root_dir={tmp_path / 'envs'}"])
    assert res.exit_code == 0, res.output
    val = json.loads(res.stdout.strip().splitlines()[-1])["validation"]
    assert val["which"] == "variants" and val["tasks"] == 3 and val["validated_tasks"] == 3
    assert "base" not in val["by_perturbation"]
