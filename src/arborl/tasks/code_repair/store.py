"""Tasks on disk, and reading them back with errors that name the file and what is wrong.

One directory per task, named by its content hash::

    <hash>/task.json     id, template, tier, split, statement, the test names, facts (meta)
    <hash>/repo/         the buggy repository: the agent's workspace starts as a copy of it
    <hash>/tests/        the hidden tests (never in the agent's sandbox)
    <hash>/gold/         the fixed versions of the files the gold patch changes
    <hash>/gold.diff     the same patch as a unified diff (for people)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arborl.envs.base import EnvError
from arborl.tasks.code_repair.generate import TaskFiles
from arborl.tasks.code_repair.statement import render

TASK_FILE = "task.json"
_REQUIRED = {"id": str, "hash": str, "tier": str, "split": str, "statement": str, "tests": list, "meta": dict}


class TaskFileError(EnvError):
    """A task directory is malformed; the message names the file and what is wrong."""


@dataclass
class RepairTask:
    """A code-repair task as stored: where its parts lie, and its facts."""

    id: str
    hash: str
    dir: Path
    tier: str
    split: str
    statement: str
    tests: list[str]  # the hidden test function names the reward counts
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def repo(self) -> Path:
        return self.dir / "repo"

    @property
    def tests_dir(self) -> Path:
        return self.dir / "tests"

    @property
    def gold_dir(self) -> Path:
        return self.dir / "gold"

    def files(self) -> TaskFiles:
        """The task as data again (same content, same hash): what perturbations take."""
        return TaskFiles(read_files(self.repo), read_files(self.gold_dir), read_files(self.tests_dir), dict(self.meta))

    def gold_files(self) -> dict[str, str]:
        return {p.relative_to(self.gold_dir).as_posix(): p.read_text() for p in sorted(self.gold_dir.rglob("*")) if p.is_file()}


def split_of(task_hash: str, eval_fraction: float = 0.2) -> str:
    """train or eval, fixed by the hash (a variant takes its origin's split, so they never cross)."""
    return "eval" if int(task_hash[:8], 16) / 0x1_0000_0000 < eval_fraction else "train"


def write_task(tf: TaskFiles, root: Path, *, split: str | None = None) -> Path:
    """Write ``tf`` under ``root/<hash>`` (complete or not at all); returns the directory."""
    h = tf.hash
    out = root / h
    if (out / TASK_FILE).is_file():
        return out
    tmp = root / f".{h}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for part in ("repo", "gold", "tests"):
        for rel, text in getattr(tf, part).items():
            p = tmp / part / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    (tmp / "gold.diff").write_text(tf.diff())
    record = {"id": f"cr-{h[:12]}", "hash": h, "tier": tf.meta["tier"], "split": split or split_of(h),
              "statement": render(tf.meta), "tests": list(tf.meta["tests"]), "meta": tf.meta}
    (tmp / TASK_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_files(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()} if d.is_dir() else {}


def load_task(d: Path) -> RepairTask:
    """The task stored in directory ``d``; TaskFileError naming the file and the fault otherwise."""
    d = Path(d)
    f = d / TASK_FILE
    if not f.is_file():
        raise TaskFileError(f"{f}: missing; a code-repair task directory holds task.json, repo/, tests/ and gold/")
    try:
        rec = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(rec, dict):
        raise TaskFileError(f"{f}: must hold a JSON object, got {type(rec).__name__}")
    for key, typ in _REQUIRED.items():
        if key not in rec:
            raise TaskFileError(f"{f}: missing key {key!r}")
        if not isinstance(rec[key], typ):
            raise TaskFileError(f"{f}: {key!r} must be a {typ.__name__}, got {type(rec[key]).__name__}")
    if rec["split"] not in ("train", "eval"):
        raise TaskFileError(f"{f}: 'split' must be train or eval, got {rec['split']!r}")
    if not rec["tests"] or not all(isinstance(t, str) and t.startswith("test") for t in rec["tests"]):
        raise TaskFileError(f"{f}: 'tests' must list the hidden test function names (test_...), got {rec['tests']!r}")
    task = RepairTask(id=rec["id"], hash=rec["hash"], dir=d, tier=rec["tier"], split=rec["split"],
                      statement=rec["statement"], tests=rec["tests"], meta=rec["meta"])
    for sub in ("repo", "tests", "gold"):
        if not (d / sub).is_dir():
            raise TaskFileError(f"{d / sub}: missing directory (the task's {sub})")
    if not any(task.tests_dir.glob("test_*.py")):
        raise TaskFileError(f"{task.tests_dir}: holds no test_*.py file (the hidden tests)")
    if any(task.repo.rglob("test_*.py")):
        raise TaskFileError(f"{task.repo}: holds test files; the hidden tests must live only in tests/")
    gold = read_files(task.gold_dir)
    if not gold:
        raise TaskFileError(f"{task.gold_dir}: empty; the gold patch is the fixed version of the files it changes")
    for rel in gold:
        if not (task.repo / rel).is_file():
            raise TaskFileError(f"{task.gold_dir / rel}: the gold patch changes {rel}, which is not in {task.repo}")
    return task
