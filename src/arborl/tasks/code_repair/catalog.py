"""The suite on disk: materialised into a cache directory on first use, the same for a seed.

``<root>/index.json`` lists the base tasks' hashes, ``<root>/variants.json`` the perturbed variants'
(written the first time variants are asked for), ``<root>/tasks/<hash>/`` holds each task
(``store.py``) and ``<root>/validation.json`` the validation results (``validate.py``). Writers take
``<root>/.lock``, so processes sharing a cache directory never see half a suite.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from arborl.tasks.code_repair.generate import GENERATOR_VERSION, generate
from arborl.tasks.code_repair.perturb import variants as make_variants
from arborl.tasks.code_repair.store import RepairTask, TaskFileError, load_task, split_of, write_task

if TYPE_CHECKING:
    from arborl.config import CodeRepairConfig


def default_root(seed: int, per_template: int) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "arborl" / "code_repair"
    return base / f"v{GENERATOR_VERSION}-seed{seed}-n{per_template}"


def suite_root(cr: "CodeRepairConfig") -> Path:
    """Where the configured suite lives: ``suite_dir``, or the cache directory for its seed."""
    return Path(cr.suite_dir).expanduser() if cr.suite_dir else default_root(cr.seed, cr.per_template)


@contextmanager
def locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_index(path: Path, seed: int, per_template: int) -> list[str] | None:
    if not path.is_file():
        return None
    try:
        idx = json.loads(path.read_text())
        hashes = idx["tasks"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise TaskFileError(f"{path}: not a suite index ({e}); delete the directory to regenerate it") from e
    if (idx.get("generator"), idx.get("seed"), idx.get("per_template")) != (GENERATOR_VERSION, seed, per_template):
        raise TaskFileError(f"{path}: made for generator {idx.get('generator')} seed {idx.get('seed')} per_template "
                            f"{idx.get('per_template')}, not {GENERATOR_VERSION}/{seed}/{per_template}: point "
                            "suite_dir elsewhere or delete it")
    return hashes


def _write_index(path: Path, hashes: list[str], seed: int, per_template: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"generator": GENERATOR_VERSION, "seed": seed, "per_template": per_template,
                               "tasks": hashes}))
    tmp.replace(path)


def materialise(root: Path, seed: int, per_template: int, *, variants: bool = False) -> list[RepairTask]:
    """The suite's tasks (base first, then variants when asked), generating what is missing."""
    root = Path(root)
    tasks_dir = root / "tasks"
    base_idx, var_idx = root / "index.json", root / "variants.json"
    base = _read_index(base_idx, seed, per_template)
    var = _read_index(var_idx, seed, per_template) if variants else []
    if base is None or var is None:
        with locked(root):
            base = _read_index(base_idx, seed, per_template)
            files = generate(seed, per_template) if base is None or (variants and not var_idx.is_file()) else []
            if base is None:
                tasks_dir.mkdir(parents=True, exist_ok=True)
                base = [write_task(tf, tasks_dir).name for tf in files]
                _write_index(base_idx, base, seed, per_template)
            if variants:
                var = _read_index(var_idx, seed, per_template)
                if var is None:
                    var = []
                    for tf in files:
                        for v in make_variants(tf, seed):
                            var.append(write_task(v, tasks_dir, split=split_of(tf.hash)).name)
                    var = list(dict.fromkeys(var))  # a variant equal to another is listed once
                    _write_index(var_idx, var, seed, per_template)
    return [load_task(tasks_dir / h) for h in base + (var or [])]
