"""Model loading (GGUF SmolLM2, HF directories, tiny random Llamas) and chat-template helpers."""

from arborl.models.chat import chat_token_ids, decode, render_chat
from arborl.models.loading import (
    SMOLLM2_NAME,
    LoadedModel,
    ModelLoadError,
    dequantize_to_plain,
    ensure_smollm2_dir,
    load_model,
    load_smollm2_gguf,
    smollm2_gguf_path,
    tiny_llama,
)

__all__ = [
    "SMOLLM2_NAME",
    "LoadedModel",
    "ModelLoadError",
    "chat_token_ids",
    "decode",
    "dequantize_to_plain",
    "ensure_smollm2_dir",
    "load_model",
    "load_smollm2_gguf",
    "render_chat",
    "smollm2_gguf_path",
    "tiny_llama",
]
