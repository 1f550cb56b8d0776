"""Generate docs/knobs.md from the config models and each loss kind's settings model:
``python scripts/docs_knobs.py > docs/knobs.md``."""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel

from arborl.config import Config
from arborl.extensions import REGISTRY_KNOBS
from arborl.rewards import ADVANTAGE_ESTIMATORS
from arborl.train.policy_losses import POLICY_LOSSES


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return "None" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _row(key: str, field) -> str:
    default = json.dumps(field.get_default(call_default_factory=True), default=str)
    desc = (field.description or "").replace("|", "\\|")
    return f"| `{key}` | {_type_name(field.annotation)} | `{default}` | {desc} |"


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    rows, subs = [], []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            subs.append((f"{prefix}{name}", ann))
            continue
        rows.append(_row(f"{prefix}{name}", field))
    if rows:
        title = prefix.rstrip(".") or "top level"
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ and model is not Config else ""
        out += [f"## {title}", ""] + ([doc, ""] if doc else []) + [
            "| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
        if title == "train.loss":
            _kind_settings(out, key="train.loss.settings", kind_key="train.loss.kind", registry=POLICY_LOSSES,
                           what="loss kind", source="train/policy_losses.py")
        if title == "train.advantage":
            _kind_settings(out, key="train.advantage.settings", kind_key="train.advantage.estimator",
                           registry=ADVANTAGE_ESTIMATORS, what="estimator", source="rewards/estimators.py")
    for sub_prefix, sub in subs:
        _section(sub, sub_prefix + ".", out)


def _kind_settings(out: list[str], *, key: str, kind_key: str, registry, what: str, source: str) -> None:
    """``<key>`` of each kind registered for ``kind_key``: the fields of its ``Settings`` model."""
    out += [
        f"### {key}, per {what}",
        "",
        f"Each {what} has its own settings (the fields of its `Settings` pydantic model, {source});",
        f"set those of the chosen one under `{key}`, e.g. `--set {key}.<name>=<value>`.",
        f"A setting the chosen {what} does not have, or a value its model refuses, stops the job before the model",
        f"loads, naming `{key}.<name>`. One of your own (`{kind_key}=file.py:attr`) declares",
        "its settings the same way (docs/bring-your-own.md).",
        "",
    ]
    for kind in registry.names():
        model = getattr(registry.get(kind), "Settings", None)
        doc = (model.__doc__ or "").strip().splitlines()[0] if model is not None and model.__doc__ else ""
        out += [f"#### `{kind_key}={kind}`", ""]
        if model is None:
            out += ["No settings.", ""]
            continue
        out += ([doc, ""] if doc else []) + ["| key | type | default | meaning |", "|---|---|---|---|"]
        out += [_row(f"{key}.{name}", field) for name, field in model.model_fields.items()] + [""]


def render() -> str:
    out = [
        "# Configuration knobs",
        "",
        "Generated from the section models of `src/arborl/config/` (`config/engine.py` holds `engine.*`, and so on;",
        "each loss kind's settings come from `src/arborl/train/policy_losses.py`, each estimator's from",
        "`src/arborl/rewards/estimators.py`)",
        "by `make knobs` (`python scripts/docs_knobs.py`); a test fails when this file is stale. Set any knob in a",
        "YAML file or with `--set key.path=value`.",
        "",
        "A `--set` value is YAML: `--set rollout.eval_tasks=16`, `--set rollout.data.system_prompt='Be brief.'`. A",
        "list knob takes one item as it is (`--set rollout.data.train_files=a.jsonl`) or several in brackets,",
        "quoted for the shell: `--set 'rollout.data.train_files=[a.jsonl, b.jsonl]'` (`report.loggers` and",
        "`sim.policies` also take `a,b`; `--set rollout.data.eval_files=` is the empty list).",
        "",
        "Paths (data files, the reward file of `file.py:attr`, model and cache directories, `runs_dir`, ...): a",
        "relative path in a config file is taken from that file's folder, one given with `--set` from the working",
        "directory; `~` and absolute paths stay. They are made absolute when the config is loaded, so the run's",
        "`config.yaml` and every error name the resolved path (`src/arborl/config_paths.py` lists the path knobs).",
        "Argv lists (`rollout.agent_command`, `extra_args`) are not paths: they run from the working directory.",
        "",
    ]
    _section(Config, "", out)
    out += [
        "## Registered names",
        "",
        "These knobs name an implementation in a registry. Besides the names below, each takes a path to your",
        "own: `package.module:attr` (importable) or `path/to/file.py:attr`; a name that resolves to nothing",
        "stops the job before the model loads, naming the key. Register a built-in with the registry's",
        "`@REGISTRY.register(\"name\")` decorator; docs/architecture.md shows each extension point's signature.",
        "",
        "| key | registry | registered names |",
        "|---|---|---|",
        *[f"| `{key}` | {reg.kind} | {', '.join(f'`{n}`' for n in reg.names())} |" for key, reg in REGISTRY_KNOBS.items()],
        "",
    ]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
