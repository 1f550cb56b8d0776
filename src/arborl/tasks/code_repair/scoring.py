"""Run a task's hidden tests against a workspace (E2, ``runtime.evaluate``) and read the verdict.

The tests run as ``python -I -m pytest -rA --noconftest -c tests/pytest.ini``: isolated mode, so a
``pytest.py`` or ``sitecustomize.py`` the agent left in the workspace is not imported; no conftest and
our own ini, so a ``conftest.py`` or ``pytest.ini`` the agent wrote cannot rewrite the results; no
plugin autoload, so neither can an installed plugin. Each test
named in ``task.json`` is read from pytest's ``-rA`` summary; a test that does not report (an import
error, a timeout) counts as failed.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

from arborl.envs.base import CommandResult, Runtime, Workspace
from arborl.tasks.code_repair.store import RepairTask

# the installed pytest plugins are not the tests' business, and loading them costs seconds per run
PYTEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)")


def pytest_argv(task: RepairTask, python: str | None = None) -> list[str]:
    t = task.tests_dir.name
    return [python or sys.executable, "-I", "-B", "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--noconftest",
            "-c", f"{t}/pytest.ini", "--rootdir", ".", t]


@dataclass
class Verdict:
    """The hidden tests' results on one workspace."""

    results: dict[str, str]  # test name -> passed / failed / error / skipped / missing
    returncode: int
    timed_out: bool = False
    output: str = ""  # the tail of pytest's output
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> int:
        return sum(r == "passed" for r in self.results.values())

    @property
    def frac(self) -> float:
        return self.passed / len(self.results) if self.results else 0.0

    @property
    def all_pass(self) -> bool:
        return bool(self.results) and self.passed == len(self.results)

    def info(self) -> dict[str, Any]:
        """What the episode keeps (outcome info / episode meta)."""
        return {"tests": dict(self.results), "passed": self.passed, "total": len(self.results),
                "returncode": self.returncode, "timed_out": self.timed_out, "output_tail": self.output[-2000:]}


def parse(task: RepairTask, res: CommandResult) -> Verdict:
    """Per-test results of the hidden tests from pytest's -rA summary."""
    seen: dict[str, str] = {}
    for line in res.stdout.splitlines():
        m = _LINE.match(line)
        if not m or "::" not in m.group(2):
            continue
        path, name = m.group(2).split("::", 1)
        name = name.split("[", 1)[0]
        if not path.startswith(task.tests_dir.name + "/"):
            continue  # a test file the agent added is not a hidden test
        status = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XPASS": "failed", "XFAIL": "failed",
                  "SKIPPED": "skipped"}[m.group(1)]
        if seen.get(name, "passed") == "passed":  # a test reported twice (setup error + call) keeps the worse
            seen[name] = status
    results = {t: seen.get(t, "missing") for t in task.tests}
    return Verdict(results, res.returncode, res.timed_out, (res.stdout + res.stderr)[-4000:])


async def run_hidden_tests(runtime: Runtime, ws: Workspace, task: RepairTask, *, timeout_s: float) -> Verdict:
    """Evaluate ``ws`` with the task's hidden tests in a separate sandbox."""
    res = await runtime.evaluate(ws, task.tests_dir, pytest_argv(task), timeout_s=timeout_s, env=PYTEST_ENV)
    return parse(task, res)
