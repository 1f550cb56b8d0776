"""A plain Hugging Face model directory written from a state dict: config.json, generation_config.json,
the tokenizer's files and model.safetensors under the plain model's parameter names, what
``AutoModelForCausalLM.from_pretrained`` and ``model.source=hf`` load."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def is_hf_dir(path: str | Path) -> bool:
    """A directory holding a config and plain weights (arborl's checkpoints and exports are)."""
    path = Path(path)
    return (path / "config.json").is_file() and (path / WEIGHTS_FILE).is_file()


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def save_hf_dir(
    path: str | Path,
    state: dict[str, torch.Tensor],
    model: "PreTrainedModel",
    tokenizer: "PreTrainedTokenizerBase | None" = None,
) -> Path:
    """Write ``state`` (plain parameter names) with ``model``'s config and generation config, and the
    tokenizer if there is one, into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    if getattr(config, "tie_word_embeddings", False):  # from_pretrained ties lm_head to the embedding again
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    safetensors.torch.save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(str(path))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
