"""Checkpoints: model, optimiser, step, the caller's cursor state and every RNG, so a resumed run
continues the same run. Written to a temp directory and renamed into place (a crash mid-save leaves
the previous checkpoint intact).

A checkpoint is also a complete Hugging Face model directory: config.json, generation_config.json,
the tokenizer's files and model.safetensors under the plain model's parameter names (LoRA merged),
next to the trainer's own files (TRAINER_FILES), which ``from_pretrained`` ignores. Under LoRA the
adapters are kept apart too (lora.safetensors), so a resume continues training them.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import safetensors.torch
import torch

from arborl.failpoints import failpoint
from arborl.models.hf_dir import WEIGHTS_FILE, save_hf_dir
from arborl.train.mtp import STATE_FILE as MTP_STATE_FILE
from arborl.types import ArborlError

OneProcessTrainer = Any  # train.trainer.Trainer (not imported: Trainer.save / load call into this module)

LORA_FILE = "lora.safetensors"
REF_FILE = "ref.safetensors"
STATE_FILE = "trainer.pt"
# the rest of a checkpoint is the HF directory (and the MTP head beside it, train/mtp.py)
TRAINER_FILES = (STATE_FILE, REF_FILE, LORA_FILE, MTP_STATE_FILE)


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


def plain_state(trainer: OneProcessTrainer) -> dict[str, torch.Tensor]:
    """The policy under the plain model's parameter names: the model's own state without LoRA (no
    copy), the merged weights with it."""
    return trainer.model.state_dict() if trainer.cfg.lora_rank == 0 else trainer.engine_state()


def save_checkpoint(path: str | Path, trainer: OneProcessTrainer, extra: dict[str, Any] | None = None, *,
                    tokenizer: Any = None, also: Callable[[Path], None] | None = None) -> Path:
    """Write the checkpoint (an HF directory with ``tokenizer``'s files, plus the trainer's state);
    ``also(directory)`` writes more into it before it is renamed into place (the MTP head's trainer)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_hf_dir(tmp, plain_state(trainer), trainer.policy, tokenizer)
    failpoint("save")
    if trainer.cfg.lora_rank > 0:
        adapters = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
        safetensors.torch.save_file(adapters, str(tmp / LORA_FILE))
    if trainer.ref_model is not None:  # the KL reference is the run's start policy: keep it
        safetensors.torch.save_model(trainer.ref_model, str(tmp / REF_FILE))
    torch.save(
        {"optimizer": trainer.optimizer.state_dict(), "step": trainer.step, "extra": extra or {}, "rng": rng_state()},
        tmp / STATE_FILE,
    )
    if also is not None:
        also(tmp)
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def load_model_weights(path: str | Path, model: torch.nn.Module, filename: str = WEIGHTS_FILE) -> None:
    f = Path(path) / filename
    if not f.is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory (no {filename})")
    missing, unexpected = safetensors.torch.load_model(model, str(f), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise CheckpointError(f"{f} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def load_trainer_weights(path: str | Path, trainer: OneProcessTrainer) -> None:
    """The policy's weights into ``trainer``: under LoRA its adapters (the base model is the run's
    source, unchanged), else the plain weights."""
    path = Path(path)
    lora = path / LORA_FILE
    if trainer.cfg.lora_rank == 0 or not lora.is_file():  # full fine-tuning, or an older arborl's LoRA checkpoint
        load_model_weights(path, trainer.model)
        return
    missing, unexpected = safetensors.torch.load_model(trainer.model, str(lora), strict=False)
    missing = [m for m in missing if "lora_" in m]
    if missing or unexpected:
        raise CheckpointError(f"{lora} does not fit this LoRA model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def has_checkpoint(path: str | Path) -> bool:
    """A checkpoint at ``path``, or the previous one of a save that was interrupted."""
    return (existing_checkpoint(path) / STATE_FILE).is_file()


def existing_checkpoint(path: str | Path) -> Path:
    return _existing(Path(path))


def _existing(path: Path) -> Path:
    """``path``, or the previous checkpoint a save was replacing when it was interrupted."""
    if path.exists():
        return path
    olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    return olds[-1] if olds else path


def load_checkpoint(path: str | Path, trainer: OneProcessTrainer) -> dict[str, Any]:
    """Restore ``trainer`` (weights, optimiser, step, RNGs) and return the saved ``extra``."""
    path = _existing(Path(path))
    load_trainer_weights(path, trainer)
    if trainer.ref_model is not None:
        if not (path / REF_FILE).is_file():
            raise CheckpointError(f"{path} has no KL reference ({REF_FILE}) but train.loss.kl_coef > 0")
        load_model_weights(path, trainer.ref_model, REF_FILE)
    try:
        state = torch.load(path / STATE_FILE, weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {STATE_FILE}") from None
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.step = state["step"]
    set_rng_state(state["rng"])
    return state["extra"]
