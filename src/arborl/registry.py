"""Name -> implementation lookups for everything users extend (tasks, agents, losses, advantage
estimators, consumption and dispatch policies, ...).

A config value is either a registered name (``train.loss.kind=ppo``) or a path to the user's own
object: ``package.module:attr`` (importable) or ``path/to/file.py:attr`` (a file anywhere; a config
file's relative paths are made absolute from its folder when it is loaded, config_paths.py; what is
still relative here is the working directory's). So a new loss or task is one file and one config line,
as slime's ``--rollout-function-path`` and verl's ``register_policy_loss``. Built-in entries are
registered by the module that defines them, with the ``register`` decorator of its registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from arborl.types import ArborlError

T = TypeVar("T")


class RegistryError(ArborlError, ValueError):
    """A name that is neither registered nor a loadable ``module:attr`` / ``file.py:attr`` path."""


def load_object(path: str) -> Any:
    """The object a ``module:attr`` or ``file.py:attr`` path names (attr may be dotted)."""
    target, sep, attr = path.rpartition(":")
    if not sep or not target or not attr:
        raise RegistryError(f"{path!r} is not a module:attr or file.py:attr path")
    if target.endswith(".py"):
        file = Path(target).expanduser().resolve()
        if not file.is_file():
            raise RegistryError(f"{path!r}: file {file} does not exist")
        name = f"arborl_user_{abs(hash(str(file))):x}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[name]
                raise RegistryError(f"{path!r}: importing {file} failed: {e!r}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise RegistryError(f"{path!r}: cannot import module {target!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RegistryError(f"{path!r}: {target} has no attribute {attr!r}") from None
    return obj


class Registry(Generic[T]):
    """Named implementations of one extension point (``kind`` names it in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@LOSSES.register("mine")`` above a function or class."""

        def add(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise RegistryError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return add

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def get(self, name: str) -> T:
        """The registered entry, or the object a ``module:attr`` / ``file.py:attr`` path names."""
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return load_object(name)
        raise RegistryError(
            f"unknown {self.kind} {name!r}: choose one of {', '.join(self.names())}, or give a path to your own, "
            "package.module:attr or path/to/file.py:attr"
        )
