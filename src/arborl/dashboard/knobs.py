"""A run's knobs next to their defaults and descriptions (from the pydantic config tree)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from arborl.config import Config

_MISSING = object()
# knobs whose value is a credential (gateway.admin_key): the dashboard, served beside the gateway, never shows it
SECRET = re.compile(r"(^|[._])(admin_key|api_key|secret|password)$")


def _hide(v: Any) -> Any:
    if isinstance(v, dict):  # a recorded change: {"from": ..., "to": ...}
        return {k: _hide(x) for k, x in v.items()}
    return None if v is None else "***"


def redact(data: Any) -> Any:
    """``data`` with the value of every credential knob replaced by "***" (None stays None)."""
    if isinstance(data, dict):
        return {k: _hide(v) if SECRET.search(str(k)) else redact(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def knob_rows(data: dict[str, Any], model: type[BaseModel] = Config, prefix: str = "") -> list[dict[str, Any]]:
    """[{"key", "value", "default", "changed", "description"}] for every knob of ``model``; ``value`` is the
    run's (from its config.yaml data), or the default where the file does not name the knob."""
    rows: list[dict[str, Any]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        given = data.get(name, _MISSING) if isinstance(data, dict) else _MISSING
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += knob_rows(given if isinstance(given, dict) else {}, ann, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        value = default if given is _MISSING else given
        rows.append({"key": prefix + name, "value": value, "default": default, "changed": value != default,
                     "description": field.description or ""})
    known = set(model.model_fields)
    for name in sorted(set(data) - known) if isinstance(data, dict) else []:  # a key this arborl does not know
        rows.append({"key": prefix + name, "value": data[name], "default": None, "changed": True,
                     "description": "(not a knob of this arborl version)"})
    return rows
