"""A chosen kind's own settings: the knobs of the one implementation a registry key picks (a loss kind,
``train.loss.settings``; an advantage estimator, ``train.advantage.settings``).

A kind declares its settings as a small pydantic model, its ``Settings`` attribute
(:func:`with_settings`); the model is the one place a setting's default is written: the function takes
the settings as keyword arguments without defaults, and :func:`with_settings` fills the ones a caller
leaves out from the model. :func:`resolve_settings` checks the configured settings against the model
(before any work), and :func:`named_context` hands a kind the tensors or values its signature names.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from arborl.config.base import ConfigError
from arborl.registry import Registry, RegistryError

F = TypeVar("F", bound=Callable[..., Any])


class KindSettings(BaseModel):
    """Base of a built-in kind's settings: typed, frozen, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _takes_any_keyword(fn: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def with_settings(model: type[BaseModel]) -> Callable[[F], F]:
    """Decorator: ``model`` is the function's ``Settings``. Its fields are the function's keyword
    settings, and a setting the caller leaves out takes the model's default (so the default is written
    once, in the model). A field the signature does not take is refused at import."""

    def attach(fn: F) -> F:
        params = inspect.signature(fn).parameters
        if not _takes_any_keyword(fn):
            missing = [name for name in model.model_fields if name not in params]
            if missing:
                raise TypeError(f"{fn.__qualname__}: its Settings {model.__name__} has {', '.join(missing)}, "
                                "which its signature does not take")
        defaults = {name: field.get_default(call_default_factory=True) for name, field in model.model_fields.items()}

        @functools.wraps(fn)
        def with_defaults(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **{**defaults, **kwargs})

        with_defaults.Settings = model  # type: ignore[attr-defined]
        return with_defaults  # type: ignore[return-value]

    return attach


def _errors(err: ValidationError, key: str) -> str:
    return "; ".join(f"{'.'.join([key, *(str(p) for p in e['loc'])])}: {e['msg']} (got {e.get('input')!r})"
                     for e in err.errors())


def resolve_settings(fn: Callable[..., Any], given: Mapping[str, Any], *, key: str, kind: str,
                     context: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings ``given`` for the kind ``fn`` (configured as ``kind``, e.g. ``train.loss.kind=ppo``),
    validated by its ``Settings`` model with its defaults filled in, as keyword arguments. Raises
    :class:`ConfigError` naming ``<key>.<field>``: not one of the kind's settings, or a value its model
    refuses. A setting may not take the name of a ``context`` value the kind receives by name."""
    model: type[BaseModel] | None = getattr(fn, "Settings", None)
    fields = list(model.model_fields) if model is not None else []
    unknown = sorted(set(given) - set(fields))
    if unknown:
        has = f"its settings are {', '.join(fields)}" if fields else (
            "it has none (a kind declares its own as a pydantic model, its `Settings` attribute)")
        raise ConfigError(f"{key}.{unknown[0]}: not a setting of {kind}; {has} (docs/knobs.md, {key})")
    if model is None:
        return {}
    if clash := set(fields) & set(context):
        raise ConfigError(f"{kind}: a setting may not be called {', '.join(sorted(clash))} "
                          "(the caller passes that value under its name)")
    try:
        settings = model.model_validate(dict(given))
    except ValidationError as e:
        raise ConfigError(_errors(e, key)) from None
    return {name: getattr(settings, name) for name in fields}


def resolve_kind(registry: Registry[Any], name: str, given: Mapping[str, Any], *, kind_key: str,
                 settings_key: str, context: tuple[str, ...] = ()) -> tuple[Any, dict[str, Any]]:
    """The implementation ``name`` picks in ``registry`` (configured as ``kind_key``) and its settings
    ``given`` (configured under ``settings_key``), checked by :func:`resolve_settings`. Raises
    :class:`ConfigError` naming ``kind_key`` when nothing goes by that name."""
    try:
        fn = registry.get(name)
    except RegistryError as e:
        raise ConfigError(f"{kind_key}: {e}") from None
    return fn, resolve_settings(fn, given, key=settings_key, kind=f"{kind_key}={name}", context=context)


def named_context(fn: Callable[..., Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``given`` that ``fn``'s signature names (all of them for a ``**kwargs`` function)."""
    if _takes_any_keyword(fn):
        return dict(given)
    params = inspect.signature(fn).parameters
    return {k: v for k, v in given.items() if k in params}
