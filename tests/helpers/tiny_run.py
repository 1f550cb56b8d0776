"""A tiny training job (random 1-layer Llama with SmolLM2's tokenizer, the even_tokens task) that runs a
step in about a second, as `--set` overrides for the CLI and as a Config for in-process runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from arborl.config import Config, load_config

TINY = [
    "seed=3", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
    "engine.max_seq_len=512", "engine.max_batch_size=16",
    "rollout.task=even_tokens", "rollout.batch_tasks=4", "rollout.group_size=4", "rollout.max_tokens=8",
    "rollout.eval_tasks=0", "train.lr=0.1", "scheduling.timeline=false",
]


def overrides(runs_dir: Path, name: str, *extra: str) -> list[str]:
    return [f"runs_dir={runs_dir}", f"name={name}", *TINY, *extra]


def tiny_cfg(runs_dir: Path, name: str, *extra: str) -> Config:
    return load_config(None, overrides(runs_dir, name, *extra))


def set_args(items: list[str]) -> list[str]:
    """``["a=1", "b=2"]`` -> ``["--set", "a=1", "--set", "b=2"]``."""
    return [x for item in items for x in ("--set", item)]


def arborl_cmd(*args: str) -> list[str]:
    """The ``arborl`` command as a user runs it, in a subprocess."""
    return [sys.executable, "-m", "arborl.cli", *args]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
