"""Environments: sandboxed workspaces for agent episodes (see base.py and docs/envs.md).

``make_runtime(cfg.envs)`` gives the configured runtime: ``bwrap`` (the sandbox; the default) or
``local`` (no isolation, an explicit opt-in), or a user's class by ``module:attr`` / ``file.py:attr``.
"""

from __future__ import annotations

from arborl.config import EnvsConfig
from arborl.envs.base import (
    ENV_RUNTIMES,
    CommandResult,
    EnvError,
    InfraError,
    Limits,
    Runtime,
    SandboxUnavailableError,
    Workspace,
)


def make_runtime(cfg: EnvsConfig | None = None) -> Runtime:
    """The runtime ``cfg.runtime`` names, built from ``cfg``; SandboxUnavailableError where bwrap cannot run."""
    from arborl.envs import bwrap, local  # noqa: F401  (they register themselves)

    cfg = cfg or EnvsConfig()
    return ENV_RUNTIMES.get(cfg.runtime)(cfg)


__all__ = [
    "ENV_RUNTIMES", "CommandResult", "EnvError", "InfraError", "Limits", "Runtime", "SandboxUnavailableError",
    "Workspace", "make_runtime",
]  # fmt: skip
