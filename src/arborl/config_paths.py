"""The knobs that hold a path, and where a relative one is taken from.

A relative path read from a config file is the config file's folder's (a config kept beside its data
names ``train.jsonl``); one given with ``--set`` is the working directory's; ``~`` and absolute paths
stay as they are. Both become absolute when the config is loaded (``config.load_data``), so the run's
config.yaml, a resume from another folder and every error name the resolved path.

Three kinds of knob, listed in ``PATH_KNOBS``:

* ``path``: a file or directory (a list knob: each item); ``""`` and None mean "unset" and stay.
* ``ref``: a registered name, ``package.module:attr``, or ``path/to/file.py:attr`` (registry.load_object);
  only the file of the last form is a path (and a whole ``path/to/file.py``, which rollout.verifiers.env takes).
* ``command``: an executable: a name looked up on PATH (``python``, ``auto``) stays, one with a ``/`` is a path.

``rollout.agent_command`` and the ``extra_args`` knobs are argv lists, not paths: the program runs from
the working directory, as a shell would run it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

PathKind = Literal["path", "ref", "command"]

# dotted key -> kind; tests/test_config_paths.py checks that every knob named like a path is here and
# that every registry knob (extensions.REGISTRY_KNOBS) is a ref
PATH_KNOBS: dict[str, PathKind] = {
    "runs_dir": "path",
    "model.path": "path",
    "model.cache_dir": "path",
    "engine.backend": "ref",
    "engine.spec.drafter": "ref",
    "engine.spec.profile_path": "path",
    "engine.spec.mtp_path": "path",
    "engine.spec.draft_model_path": "path",
    "engine.vllm.python": "command",
    "engine.vllm.work_dir": "path",
    "engine.sglang.python": "command",
    "engine.sglang.work_dir": "path",
    "train.advantage.estimator": "ref",
    "train.loss.kind": "ref",
    "train.mtp.save_path": "path",
    "rollout.task": "ref",
    "rollout.agent": "ref",
    "rollout.data.train_files": "path",
    "rollout.data.eval_files": "path",
    "rollout.data.reward_function": "ref",
    "rollout.code_repair.suite_dir": "path",
    "rollout.gym.env": "ref",
    "rollout.harbor.tasks_dir": "path",
    "rollout.verifiers.env": "ref",
    "rollout.verifiers.python": "command",
    "rollout.envs.runtime": "ref",
    "rollout.envs.root_dir": "path",
    "rollout.envs.ro_binds": "path",
    "rollout.envs.bwrap_path": "command",
    "scheduling.consume": "ref",
    "scheduling.dispatch": "ref",
    "report.loggers": "ref",
    "cluster.shared_dir": "path",
    "sim.gantt_dir": "path",
}


def absolute(path: str, base: str | Path) -> str:
    """``path`` against ``base``: ``~`` and absolute paths unchanged, a relative one joined and normalised."""
    if path.startswith("~") or os.path.isabs(path):
        return path
    return os.path.abspath(os.path.join(base, path))


def _one(kind: PathKind, value: Any, base: str | Path) -> Any:
    if not isinstance(value, str) or not value:
        return value
    if kind == "path":
        return absolute(value, base)
    if kind == "command":
        return absolute(value, base) if "/" in value else value
    if value.endswith(".py"):  # a whole file (rollout.verifiers.env names a module file so)
        return absolute(value, base)
    target, sep, attr = value.rpartition(":")  # ref: only file.py:attr holds a path
    return f"{absolute(target, base)}{sep}{attr}" if sep and target.endswith(".py") else value


def resolve_value(key: str, value: Any, base: str | Path) -> Any:
    """``value`` given for the dotted ``key`` (a knob or a whole section) with its paths against ``base``."""
    if isinstance(value, dict):
        return {k: resolve_value(f"{key}.{k}", v, base) for k, v in value.items()}
    kind = PATH_KNOBS.get(key)
    if kind is None:
        return value
    if isinstance(value, list):
        return [_one(kind, v, base) for v in value]
    return _one(kind, value, base)


def resolve_paths(data: dict[str, Any], base: str | Path) -> dict[str, Any]:
    """The keys of a config file (nested sections) with every path knob's relative paths against ``base``."""
    return {k: resolve_value(k, v, base) for k, v in data.items()}
