"""Chat-template helpers returning plain Python types across transformers versions.

SmolLM2-135M-Instruct's chat template (ChatML) **ignores ``tools`` entirely**: it renders
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, prepends a default system message
("You are a helpful AI assistant named SmolLM, trained by Hugging Face") when the first message
is not a system one, and appends ``<|im_start|>assistant\\n`` for the generation prompt. It reads
only ``role`` and ``content`` (``content`` must be a string; ``tool_calls`` are dropped and a
``tool`` role is rendered like any other role). Tool descriptions for SmolLM2 must therefore be
written into the system message by the caller; ``tools`` is still passed through for templates
that use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]


def _as_int_list(out: Any) -> list[int]:
    """apply_chat_template's tokenized output (list, nested list, tensor, BatchEncoding) -> list[int]."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], (list, tuple)):
        out = list(out[0])
    return [int(t) for t in out]


def chat_token_ids(
    tokenizer: "PreTrainedTokenizerBase",
    messages: Sequence[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template (no extra BOS/EOS)."""
    out = tokenizer.apply_chat_template(
        list(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return _as_int_list(out)


def render_chat(
    tokenizer: "PreTrainedTokenizerBase",
    messages: Sequence[Message],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's text for ``messages``."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return str(text)


def decode(tokenizer: "PreTrainedTokenizerBase", ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """Text of ``ids``, special tokens kept by default, without whitespace clean-up."""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
