"""A run directory's own config.

``config.yaml`` is written once, when a run starts, and never rewritten. A resume that changes knobs
that may change (steps, evaluation, learning rate, ...) appends a record to ``config.changes.yaml``;
the run's config is config.yaml with those records replayed. Knobs that say what the checkpoint is
(the model and its tokenizer, LoRA, the seed) cannot change: the checkpoint fits only them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from arborl.config import Config, ConfigError, load_data, validate_config

CONFIG_FILE = "config.yaml"
CHANGES_FILE = "config.changes.yaml"

LOCATION = ("name", "runs_dir")  # where the run lives, not what it is: taken from the directory
MODEL_IDENTITY = ("model.source", "model.path", "model.dtype", "model.tiny_layers", "model.tiny_hidden",
                  "model.tiny_vocab", "model.tiny_tokenizer", "model.seed")
FROZEN_FOR_RESUME = ("seed", *MODEL_IDENTITY, "train.lora_rank", "train.lora_alpha", "train.lora_targets")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaves of nested sections as dotted keys (lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _set_key(data: dict[str, Any], key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    for s in sections:
        data = data.setdefault(s, {})
    data[leaf] = value


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_changes(run_dir: str | Path) -> list[dict[str, Any]]:
    f = Path(run_dir) / CHANGES_FILE
    if not f.is_file():
        return []
    records = yaml.safe_load(f.read_text()) or []
    if not isinstance(records, list):
        raise ConfigError(f"{f} must hold a list of change records")
    return records


def run_config(run_dir: str | Path) -> Config:
    """config.yaml of ``run_dir`` with its recorded changes replayed, located at ``run_dir``."""
    run_dir = Path(run_dir)
    f = run_dir / CONFIG_FILE
    if not f.is_file():
        raise ConfigError(f"{run_dir} has no {CONFIG_FILE}: not a run directory (start a run there without --resume)")
    data = load_data(f, relative_to_file=False)  # written with absolute paths (older runs: the cwd's)
    for record in read_changes(run_dir):
        for key, change in (record.get("changes") or {}).items():
            _set_key(data, key, change["to"])
    data["name"], data["runs_dir"] = run_dir.name, str(run_dir.parent)
    return validate_config(data)


def run_dir_of(config: str | Path | None, overrides: list[str]) -> tuple[Path, dict[str, Any]]:
    """The run a command names, and the keys it gives: ``config`` is a run directory, a run's name
    (under runs_dir), or a YAML file; without it, name / runs_dir (after ``overrides``) locate the run."""
    fields = Config.model_fields
    if config is not None:
        p = Path(config)
        if p.is_dir():
            return p, load_data(None, overrides)
        if not p.exists() and p.suffix not in (".yaml", ".yml") and len(p.parts) == 1:  # a name
            data = load_data(None, overrides)
            return Path(str(data.get("runs_dir", fields["runs_dir"].default))) / p.name, data
    data = load_data(config, overrides)
    name = data.get("name", fields["name"].default)
    runs_dir = data.get("runs_dir", fields["runs_dir"].default)
    return Path(str(runs_dir)) / str(name), data


def config_of_run(run_dir: str | Path, data: dict[str, Any]) -> Config:
    """The run's config with ``data`` (keys from a file and ``--set``) on top; the location stays the run's."""
    base = run_config(run_dir)
    top = {k: v for k, v in data.items() if k not in LOCATION}
    return validate_config(_merge(base.model_dump(mode="json"), top))


def differences(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Knobs whose value differs, {key: (old, new)}; the location is not compared."""
    a, b = flatten(old.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and k not in LOCATION}


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def check_frozen(changes: dict[str, tuple[Any, Any]], frozen: tuple[str, ...], what: str, why: str) -> None:
    """ConfigError (one line) naming each key of ``frozen`` that ``changes`` touch, with both values."""
    bad = [k for k in changes if k in frozen]
    if bad:
        given = ", ".join(f"{k}={_show(changes[k][1])}" for k in bad)
        had = ", ".join(f"{k}={_show(changes[k][0])}" for k in bad)
        raise ConfigError(f"cannot {what} with {given}: the run has {had}; {why}")


def resume_changes(run_dir: str | Path, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """What ``cfg`` changes in the run's config; ConfigError if a change cannot resume."""
    changes = differences(run_config(run_dir), cfg)
    check_frozen(changes, FROZEN_FOR_RESUME, f"resume {run_dir}",
                 "a resume keeps the model, LoRA and seed its checkpoint was trained with (drop the override, or "
                 "start a new run under another name)")
    return changes


def record_changes(run_dir: str | Path, changes: dict[str, tuple[Any, Any]], at_step: int) -> None:
    """Append one record to config.changes.yaml (written to a temp file, then renamed into place)."""
    if not changes:
        return
    run_dir = Path(run_dir)
    records = read_changes(run_dir)
    records.append({"at_step": at_step, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "changes": {k: {"from": old, "to": new} for k, (old, new) in changes.items()}})
    tmp = run_dir / f".{CHANGES_FILE}.tmp-{os.getpid()}"
    tmp.write_text(yaml.safe_dump(records, sort_keys=False))
    tmp.replace(run_dir / CHANGES_FILE)


def resume_config(config: str | Path | None, overrides: list[str]) -> Config:
    """The config ``arborl train --resume`` runs: the named run's own, with the given keys on top
    (a run directory without config.yaml falls back to the given keys alone)."""
    run_dir, data = run_dir_of(config, overrides)
    if not (run_dir / CONFIG_FILE).is_file():
        return validate_config(_merge(data, {"name": run_dir.name, "runs_dir": str(run_dir.parent)}))
    return config_of_run(run_dir, data)


def eval_config(config: str | Path | None, overrides: list[str], checkpoint: str | Path | None) -> Config:
    """The config ``arborl eval`` runs: for runs/NAME/checkpoint that run's own, with the given keys on
    top (the model cannot change: the checkpoint fits only the run's); else the given keys."""
    run_dir = Path(checkpoint).parent if checkpoint is not None else None
    if run_dir is None or not (run_dir / CONFIG_FILE).is_file():
        return validate_config(load_data(config, overrides))
    cfg = config_of_run(run_dir, load_data(config, overrides))
    check_frozen(differences(run_config(run_dir), cfg), MODEL_IDENTITY, f"evaluate {checkpoint}",
                 "the checkpoint fits only that model (drop the override; to evaluate another model, leave out "
                 "--checkpoint)")
    return cfg
