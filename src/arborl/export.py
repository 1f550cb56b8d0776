"""``arborl export RUN_DIR [--out DIR]``: the run's policy as a plain Hugging Face model directory
(config.json, generation config, tokenizer files, model.safetensors with LoRA merged), loadable by
``AutoModelForCausalLM.from_pretrained`` and by ``model.source=hf model.path=DIR``.

A checkpoint written by this arborl already is such a directory: its files are copied, without the
trainer's state. An older checkpoint (weights only) is rebuilt from the run's config.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from arborl.models.hf_dir import is_hf_dir, save_hf_dir
from arborl.models.loading import load_model
from arborl.run_config import run_config
from arborl.train.checkpoint import (
    STATE_FILE,
    TRAINER_FILES,
    CheckpointError,
    existing_checkpoint,
    load_trainer_weights,
    plain_state,
)
from arborl.train.trainer import Trainer
from arborl.types import ArborlError


class ExportError(ArborlError):
    """The export's destination cannot be written."""


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) of a run directory or of a checkpoint directory."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path.parent, path
    ckpt = existing_checkpoint(path / "checkpoint")
    if not (ckpt / STATE_FILE).is_file():
        raise CheckpointError(f"{path} holds no checkpoint: a run saves one at its end, every "
                              "rollout.checkpoint_every steps, and when Ctrl-C / SIGTERM stops it")
    return path, ckpt


def export_run(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the policy of the run (or checkpoint) at ``path`` to ``out`` (default <run>/export)."""
    run_dir, ckpt = find_checkpoint(path)
    out = Path(out) if out is not None else run_dir / "export"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists: choose another --out, or delete it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if is_hf_dir(ckpt):
            tmp.mkdir()
            for f in ckpt.iterdir():
                if f.is_file() and f.name not in TRAINER_FILES:
                    shutil.copy2(f, tmp / f.name)
        else:
            _rebuild(run_dir, ckpt, tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _rebuild(run_dir: Path, ckpt: Path, dest: Path) -> None:
    """An older checkpoint (weights under the trainer's names only) as an HF directory."""
    cfg = run_config(run_dir)
    loaded = load_model(cfg.model)
    trainer = Trainer(loaded.model, cfg.train)
    load_trainer_weights(ckpt, trainer)
    save_hf_dir(dest, plain_state(trainer), trainer.policy, loaded.tokenizer)
