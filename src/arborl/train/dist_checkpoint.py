"""Checkpoints of a rank group: torch.distributed.checkpoint (DCP) shards + the HF directory.

    <path>/                 config.json, model.safetensors, ... : the whole policy, gathered on rank 0,
                            so `arborl export | eval | serve` and from_pretrained read it as today
    <path>/dcp/             the sharded model + optimiser state (DCP; each rank writes its shards)
    <path>/trainer.pt       step and the caller's extra state (rank 0)
    <path>/rng-<rank>.pt    each rank's RNG state

Written into a temporary sibling directory and renamed into place by rank 0 after every rank is
done (a crash mid-save leaves the previous checkpoint). DCP reshards on load: a checkpoint
written by N ranks loads into M ranks (same strategy family: model and optimiser state dicts are
saved under their plain, unsharded names); the RNG files of missing ranks are then skipped.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from arborl.models.hf_dir import save_hf_dir
from arborl.train.checkpoint import STATE_FILE, CheckpointError, rng_state, set_rng_state

if TYPE_CHECKING:
    from arborl.train.parallel import ShardedTrainer

DCP_DIR = "dcp"


def full_state(trainer: "ShardedTrainer") -> dict[str, torch.Tensor] | None:
    """The whole model state on rank 0 (CPU), gathered at once; None on the other ranks."""
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if trainer.rank == 0 else None


def _tmp(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-dcp"


def save(path: str | Path, trainer: "ShardedTrainer", extra: dict[str, Any] | None = None, *, tokenizer: Any = None) -> Path:
    """Every rank calls it: shards via DCP, the HF directory and trainer state from rank 0."""
    path = Path(path)
    tmp = _tmp(path)
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    full = full_state(trainer)
    torch.save(rng_state(), tmp / f"rng-{trainer.rank}.pt")
    if trainer.rank == 0:
        save_hf_dir(tmp, full, trainer.policy, tokenizer)
        torch.save({"step": trainer.step, "extra": extra or {}, "world": trainer.world}, tmp / STATE_FILE)
    del full
    dist.barrier()
    if trainer.rank == 0:
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load(path: str | Path, trainer: "ShardedTrainer") -> dict[str, Any]:
    """Every rank calls it: restore weights, optimiser state, step and this rank's RNG; the saved extra."""
    path = Path(path)
    if not (path / DCP_DIR).is_dir() or not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {DCP_DIR}/ or {STATE_FILE})")
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = torch.load(path / STATE_FILE, weights_only=False)
    trainer.step = meta["step"]
    rng = path / f"rng-{trainer.rank}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return meta["extra"]
