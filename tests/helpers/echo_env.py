"""A multi-turn Gymnasium-style env that answers every reply with "Again.": a tiny random model's replies come
back as the next prompt's history, so later calls of an episode re-render earlier replies (the audit tests)."""

from __future__ import annotations

from pathlib import Path

ECHO_ENV = """
class Echo:
    def reset(self, seed=None):
        return "Say something.", {}

    def step(self, action):
        return "Again.", 0.0, False, False, {}
"""


def echo_env(folder: Path, name: str = "echo.py") -> str:
    """Write the env into ``folder`` as ``name``; its ``rollout.gym.env`` value."""
    path = Path(folder) / name
    path.write_text(ECHO_ENV)
    return f"{path}:Echo"
