"""The model an external server serves, as Hugging Face directories in a work directory: ``v<N>/``
holds policy version N (config, generation config, ``model.safetensors``). A server (re)starts from
the newest one and loads weight updates from the next; older ones are deleted."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from arborl.models.hf_dir import WEIGHTS_FILE

CONFIG_FILES = ("config.json", "generation_config.json")


def default_work_dir(prefix: str) -> Path:
    """A fresh directory in RAM when the machine has /dev/shm (weight updates are written there)."""
    shm = Path("/dev/shm")
    parent = str(shm) if shm.is_dir() and _writable(shm) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def _writable(path: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


class ModelDirs:
    """Versions of one model under ``root``. A model with tied input and output embeddings is written
    untied (``lm_head.weight`` saved, ``tie_word_embeddings: false``): vLLM's in-place reload updates
    the embedding but not the output layer it derived from it at load, so a tied model would keep
    its old head after a weight update. The values are the same, only stored twice."""

    def __init__(self, root: Path, model: nn.Module, version: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.untie = bool(getattr(model.config, "tie_word_embeddings", False))
        path = self.root / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(str(path))
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(str(path))
        config = json.loads((path / "config.json").read_text())
        if not config.get("architectures"):  # servers pick the model class from it
            config["architectures"] = [type(model).__name__]
        if self.untie:
            config["tie_word_embeddings"] = False
        (path / "config.json").write_text(json.dumps(config, indent=2))
        self._save(model.state_dict(), path)
        self.current = path

    def _save(self, state: dict[str, torch.Tensor], path: Path) -> None:
        tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}  # no shared storage
        if self.untie and "lm_head.weight" not in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        safetensors.torch.save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})

    def write(self, state: dict[str, torch.Tensor], version: int) -> Path:
        """Write ``state`` (plain parameter names) as version ``version``; returns its directory."""
        path = self.root / f"v{version}"
        tmp = self.root / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._save(state, tmp)
        for name in CONFIG_FILES:
            if (self.current / name).is_file():
                shutil.copy2(self.current / name, tmp / name)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        return path

    def commit(self, path: Path) -> None:
        """``path`` is what the server serves now: the older versions go."""
        old, self.current = self.current, path
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
