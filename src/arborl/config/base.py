"""The ground of the config tree: its error and the base of every section."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from arborl.types import ArborlError


class ConfigError(ArborlError, ValueError):
    """A config file, key or value is wrong; the message names the key path and the reason."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def comma_list(value: Any) -> Any:
    """A comma-separated string (or a list of them: ``--set`` makes one value a one-item list) as a list
    of names."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [x.strip() for v in value for x in v.split(",") if x.strip()]
    return value

