"""The whole run's config: the root that assembles every section, YAML files and ``--set a.b=c``
overrides, and the error messages that name the key to fix."""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from arborl.config.base import ConfigError, Section
from arborl.config.cluster import ClusterConfig
from arborl.config.engine import EngineConfig
from arborl.config.datapool import DataPoolConfig
from arborl.config.gateway import GatewayConfig
from arborl.config.model import ModelConfig
from arborl.config.report import ReportConfig
from arborl.config.rollout import RolloutConfig
from arborl.config.scheduling import SchedulingConfig
from arborl.config.sim import SimConfig
from arborl.config.train import TrainConfig
from arborl.config_paths import resolve_paths, resolve_value


class Config(Section):
    """The whole run."""

    name: str = Field("default", description="run name: outputs go to <runs_dir>/<name>/")
    runs_dir: str = Field(
        "runs", description="parent directory of run directories (in a config file relative to its folder; the "
        "default and --set: the working directory's)"
    )
    seed: int = Field(0, description="global seed (sampling, data order)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    datapool: DataPoolConfig = Field(default_factory=DataPoolConfig)
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig, description="OpenAI-compatible gateway, sessions and `arborl serve`"
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="policy optimisation: advantages, loss, correction")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="episodes per step and their sampling")
    scheduling: SchedulingConfig = Field(
        default_factory=SchedulingConfig, description="rollout scheduling: consumption, dispatch, partial rollout"
    )
    sim: SimConfig = Field(default_factory=SimConfig, description="`arborl simulate` workload and cluster")
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="local or Ray deployment: actors, resources, weight sync, PD"
    )
    report: ReportConfig = Field(default_factory=ReportConfig, description="metrics loggers: jsonl, TensorBoard, W&B, MLflow")

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    @model_validator(mode="after")
    def _groups_to_compare(self) -> "Config":
        estimator = self.train.advantage.estimator
        if self.rollout.group_size < 2 and estimator in GROUP_RELATIVE_ESTIMATORS:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: the {estimator} advantage is a reward minus its "
                "group's mean, so a group of one episode always has advantage 0 and nothing is trained; set "
                "rollout.group_size to 2 or more (4-16 is usual)"
            )
        return self


# built-in advantage estimators that compare the episodes of a group (need rollout.group_size >= 2)
GROUP_RELATIVE_ESTIMATORS = ("grpo", "reward_to_go", "auto", "rloo", "reinforce_pp_baseline")


def known_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every section and knob of ``model`` as a dotted key path."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += known_keys(sub, f"{prefix}{name}.")
    return keys


def _did_you_mean(path: str) -> str:
    keys = known_keys()
    leaf = path.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]  # the knob exists, in another section
    # of several (train.lr, train.mtp.lr, train.sft.lr): those as deep as the key typed, if any, then the one
    # whose whole path is closest
    depth = path.count(".")
    same_leaf = [k for k in same_leaf if k.count(".") == depth] or same_leaf
    close = (difflib.get_close_matches(path, same_leaf, n=1, cutoff=0) if same_leaf
             else difflib.get_close_matches(path, keys, n=1, cutoff=0.6))
    return f"did you mean {close[0]}? " if close else ""


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        reason = e["msg"]
        if not path:  # a check across sections: its message names the keys
            lines.append(reason.removeprefix("Value error, "))
            continue
        if e["type"] == "extra_forbidden":
            reason = f"unknown key ({_did_you_mean(path)}see docs/knobs.md for the valid keys)"
        if e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a check across a section's knobs
            lines.append(f"{path}: {reason.removeprefix('Value error, ')}")
            continue
        lines.append(f"{path}: {reason} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"engine.max_batch_size=8"`` -> (["engine", "max_batch_size"], 8). Values are YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty component in key path {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from e
    return parts, value


def _list_knob(parts: list[str]) -> bool:
    """Whether the knob at ``parts`` holds a list."""
    model: Any = Config
    for i, p in enumerate(parts):
        field = model.model_fields.get(p) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return False
        model = field.annotation
        if i == len(parts) - 1:
            return any(typing.get_origin(a) is list for a in (model, *typing.get_args(model)))
    return False


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set`` overrides on top of ``data``: a relative path is the working directory's, and a single
    value given for a list knob is a one-item list (``--set rollout.data.train_files=a.jsonl``; an empty
    one, ``key=``, the empty list)."""
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        if value is not None and not isinstance(value, (list, dict)) and _list_knob(parts):
            value = [value] if value != "" else []  # `key=` empties the list
        node[parts[-1]] = resolve_value(".".join(parts), value, Path.cwd())
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated as one tree."""
    return validate_config(load_data(path, overrides))


def validate_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def load_data(path: str | Path | None = None, overrides: list[str] | None = None, *,
              relative_to_file: bool = True) -> dict[str, Any]:
    """The keys a YAML file and ``--set`` overrides give, unvalidated and without defaults. A relative
    path in the file is the file's folder's (``relative_to_file``; a run's own config.yaml is read as
    written), one given by ``--set`` the working directory's (config_paths.py)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(os.path.abspath(Path(path).expanduser()))  # errors name the file as resolved
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded or {}
        if relative_to_file:
            data = resolve_paths(data, p.parent)
    return apply_overrides(data, overrides or [])


def dump_config(cfg: Config) -> str:
    """``cfg`` as YAML, its relative paths made absolute (they are the working directory's), so the file
    means the same wherever it is loaded from."""
    return yaml.safe_dump(resolve_paths(cfg.model_dump(mode="json"), Path.cwd()), sort_keys=False)
