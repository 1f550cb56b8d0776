"""The code-repair generator: >= 300 deterministic tasks from >= 20 templates in three tiers, each with a
buggy repo (no tests), hidden tests, a gold patch and a statement; bad task files give clear errors."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from arborl.envs.base import EnvError
from arborl.tasks.code_repair import BUG_TEMPLATES, TaskFileError, generate, load_task, make_task, materialise, write_task
from arborl.tasks.code_repair.catalog import _write_index
from arborl.tasks.code_repair.generate import _run_checks
from arborl.types import ArborlError


@pytest.fixture(scope="module")
def suite():
    return generate(0, 16)


def test_at_least_300_tasks_from_20_templates_in_three_tiers(suite):
    assert len(BUG_TEMPLATES.names()) >= 20
    assert len(suite) >= 300
    assert len({t.hash for t in suite}) == len(suite)  # all distinct
    per_template = Counter(t.meta["template"] for t in suite)
    assert set(per_template) == set(BUG_TEMPLATES.names()) and min(per_template.values()) == 16
    tiers = Counter(t.meta["tier"] for t in suite)
    assert set(tiers) == {"easy", "medium", "hard"} and min(tiers.values()) >= 100
    assert {t.meta["layout"] for t in suite} == {"flat", "src"}
    assert len({t.meta["function"] for t in suite}) >= 60  # names vary, not one per template


def test_tasks_are_deterministic_for_a_seed_and_differ_across_seeds(suite):
    again = generate(0, 2)
    assert [t.hash for t in again] == [t.hash for t in generate(0, 2)]
    assert {t.hash for t in again} <= {t.hash for t in suite}  # the first tasks of a larger suite are the same
    assert not {t.hash for t in generate(1, 2)} & {t.hash for t in again}


def test_each_task_has_failing_and_passing_tests_and_a_gold_patch(suite):
    for t in suite:
        assert not any("test_" in p for p in t.repo), "the hidden tests are never in the repo"
        assert t.meta["failing_tests"] and set(t.meta["failing_tests"]) <= set(t.meta["tests"])
        assert len(t.meta["tests"]) >= 3  # several tests: the reward can be a fraction
        assert set(t.gold) <= set(t.repo) and all(t.gold[p] != t.repo[p] for p in t.gold)
        assert t.diff().startswith("--- a/")


def test_the_in_process_check_sees_the_bug():
    """The generator's own check: the fixed code passes every test, the buggy code fails the listed ones."""
    t = make_task("wrong_comparison", 0, 0, "easy")
    code = t.repo[t.meta["bug_file"]]
    fixed = t.gold[t.meta["bug_file"]]
    bodies = {}
    for block in t.tests["test_hidden.py"].split("\n\n\ndef ")[1:]:
        name, body = block.split("():\n", 1)
        bodies[name] = body
    assert all(_run_checks(fixed, bodies, t.meta["function"]).values())
    assert [n for n, ok in _run_checks(code, bodies, t.meta["function"]).items() if not ok] == t.meta["failing_tests"]


def test_tiers_differ_in_files_and_statement():
    easy, medium, hard = (make_task("sort_order_reversed", 0, i, tier) for i, tier in enumerate(("easy", "medium", "hard")))
    assert len(easy.repo) == 1 and len(medium.repo) == 3 and len(hard.repo) == 4
    assert medium.meta["bug_file"] != medium.meta["entry_file"]  # the bug is away from the entry point
    from arborl.tasks.code_repair.statement import render

    s_easy, s_medium, s_hard = render(easy.meta), render(medium.meta), render(hard.meta)
    assert easy.meta["bug_file"] in s_easy and "test_" in s_easy
    assert medium.meta["entry_file"] in s_medium and "test_" in s_medium
    assert "test_" not in s_hard and ".py" not in s_hard and hard.meta["function"] in s_hard


def test_materialise_is_deterministic_and_cached(tmp_path):
    a = materialise(tmp_path / "a", 5, 2)
    b = materialise(tmp_path / "b", 5, 2)
    assert [t.hash for t in a] == [t.hash for t in b] and len(a) == 2 * len(BUG_TEMPLATES.names())
    assert {t.split for t in a} == {"train", "eval"}
    # a second call reads the cache: a file changed on disk is what it returns
    (tmp_path / "a" / "tasks" / a[0].hash / "task.json").write_text(
        (tmp_path / "a" / "tasks" / a[0].hash / "task.json").read_text().replace(a[0].statement[:10], "EDITED"))
    assert materialise(tmp_path / "a", 5, 2)[0].statement.startswith("EDITED")
    with pytest.raises(TaskFileError, match="index.json: made for generator .* seed 5 .* not .*/6/2"):
        materialise(tmp_path / "a", 6, 2)


def _task_dir(tmp_path: Path) -> Path:
    return write_task(make_task("wrong_index", 0, 0, "easy"), tmp_path)


@pytest.mark.parametrize("breakage, message", [
    (lambda d: (d / "task.json").unlink(), r"task.json: missing"),
    (lambda d: (d / "task.json").write_text("{not json"), r"task.json: not valid JSON"),
    (lambda d: (d / "task.json").write_text("[1]"), r"task.json: must hold a JSON object"),
    (lambda d: _edit(d, lambda r: r.pop("tests")), r"task.json: missing key 'tests'"),
    (lambda d: _edit(d, lambda r: r.update(split="dev")), r"'split' must be train or eval"),
    (lambda d: _edit(d, lambda r: r.update(tests=[])), r"'tests' must list the hidden test function names"),
    (lambda d: shutil.rmtree(d / "gold"), r"gold: missing directory"),
    (lambda d: [p.unlink() for p in (d / "tests").glob("test_*.py")], r"tests: holds no test_\*.py file"),
    (lambda d: (d / "repo" / "test_leak.py").write_text("x = 1\n"), r"repo: holds test files"),
    (lambda d: (d / "gold" / "other.py").write_text("x = 1\n"), r"gold/other.py: the gold patch changes other.py"),
])
def test_bad_task_files_name_the_file_and_the_fault(tmp_path, breakage, message):
    d = _task_dir(tmp_path)
    load_task(d)  # intact: loads
    breakage(d)
    with pytest.raises(TaskFileError, match=message) as e:
        load_task(d)
    assert isinstance(e.value, EnvError) and isinstance(e.value, ArborlError)
    assert str(d) in str(e.value)


def _edit(d: Path, fn) -> None:
    rec = json.loads((d / "task.json").read_text())
    fn(rec)
    (d / "task.json").write_text(json.dumps(rec))


def test_a_corrupt_suite_index_is_a_clear_error(tmp_path):
    materialise(tmp_path, 0, 1)
    (tmp_path / "index.json").write_text("{}")
    with pytest.raises(TaskFileError, match=r"index.json: not a suite index"):
        materialise(tmp_path, 0, 1)
    _write_index(tmp_path / "index.json", ["0" * 64], 0, 1)
    with pytest.raises(TaskFileError, match=re.escape(str(tmp_path / "tasks" / ("0" * 64) / "task.json")) + ": missing"):
        materialise(tmp_path, 0, 1)
