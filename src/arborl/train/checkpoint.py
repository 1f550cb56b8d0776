"""Checkpoints: model, optimiser, step, the caller's cursor state and every RNG, so a resumed run
continues the same run. Written to a temp directory and renamed into place (a crash mid-save leaves
the previous checkpoint intact)."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from arborl.train.trainer import Trainer
from arborl.types import ArborlError


class CheckpointError(ArborlError):
    """A checkpoint is missing or unreadable; the message names the path."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, trainer: Trainer, extra: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    safetensors.torch.save_model(trainer.model, str(tmp / "model.safetensors"))
    if trainer.ref_model is not None:  # the KL reference is the run's start policy: keep it
        safetensors.torch.save_model(trainer.ref_model, str(tmp / "ref.safetensors"))
    torch.save(
        {"optimizer": trainer.optimizer.state_dict(), "step": trainer.step, "extra": extra or {}, "rng": rng_state()},
        tmp / "trainer.pt",
    )
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def load_model_weights(path: str | Path, model: torch.nn.Module, filename: str = "model.safetensors") -> None:
    f = Path(path) / filename
    if not f.is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory (no model.safetensors)")
    missing, unexpected = safetensors.torch.load_model(model, str(f), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise CheckpointError(f"{f} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _existing(path: Path) -> Path:
    """``path``, or the previous checkpoint a save was replacing when it was interrupted."""
    if path.exists():
        return path
    olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    return olds[-1] if olds else path


def load_checkpoint(path: str | Path, trainer: Trainer) -> dict[str, Any]:
    """Restore ``trainer`` (weights, optimiser, step, RNGs) and return the saved ``extra``."""
    path = _existing(Path(path))
    load_model_weights(path, trainer.model)
    if trainer.ref_model is not None:
        if not (path / "ref.safetensors").is_file():
            raise CheckpointError(f"{path} has no KL reference (ref.safetensors) but train.loss.kl_coef > 0")
        load_model_weights(path, trainer.ref_model, "ref.safetensors")
    try:
        state = torch.load(path / "trainer.pt", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no trainer.pt") from None
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.step = state["step"]
    set_rng_state(state["rng"])
    return state["extra"]
