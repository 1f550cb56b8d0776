"""The trainer's one face (as ``engine/face.py`` is the engines'): what the job, the controller and the
publisher use of a trainer, whichever kind trains -- one process (``train.trainer.Trainer``), ranks
as subprocesses (``train.ranks.RankGroup``) or as Ray actors (``cluster.rank_actors.RayRankGroup``).
``run.assemble.make_trainer`` chooses the kind from the config; no consumer names a concrete class."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from arborl.types import Sample


@runtime_checkable
class TrainerFace(Protocol):
    step: int  # optimiser steps taken

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimiser step on ``samples``; its metrics (``train/...``, ``loss/...``)."""
        ...

    @property
    def step_logprobs(self) -> dict[int, torch.Tensor]:
        """The last step's per-token log-probs of each sample (by index); empty where the kind keeps none."""
        ...

    @property
    def policy(self) -> nn.Module | None:
        """The policy module in this process (None: it lives in the ranks)."""
        ...

    def engine_state(self) -> dict[str, torch.Tensor]:
        """The whole policy under the plain model's names (LoRA merged): what the engines load."""
        ...

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """The LoRA adapters alone (``train.lora_sync=adapters``); None without LoRA or where unsupported."""
        ...

    def base_state(self) -> dict[str, torch.Tensor]:
        """The frozen base weights the adapters sit on."""
        ...

    def save(self, path: str | Path, extra: dict[str, Any] | None = None, *, tokenizer: Any = None,
             also: Callable[[Path], None] | None = None) -> Path:
        """A checkpoint (an HF directory plus the trainer's state and ``extra``); ``also(dir)`` writes more into it."""
        ...

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by ``save``; returns its ``extra``."""
        ...

    def close(self) -> None:
        ...
