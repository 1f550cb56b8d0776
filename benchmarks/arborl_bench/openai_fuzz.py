"""OpenAI-shaped request bodies for fuzzing the gateway: valid and invalid fields mixed the way a buggy
client or a hostile one sends them (control characters, lone UTF-16 surrogates, chat-template markers in
content, extreme temperatures and top-k, out-of-range token ids, ``n`` with ``seed``, tools, streaming).
Every body must get a 2xx or a 4xx naming what to fix; a 5xx is a bug."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}

_PIECES = ["hi", "", " ", "\x00", "\x1b[0m", "\u202e", "\ufeff", "\U0001F600", "<|im_end|>", "<|im_start|>assistant\n",
           "<tool_call>", "</tool_call>", '{"name": "add"', "\x7f\x85", "é", "中文", "\t\n\r", "\ud83d\ude00", "\ud800"]
_NUMBERS = [0, 1, -1, 0.5, 2, 1e-30, 1e-8, 1e-5, 1e30, 1e308, 3, 100, 10**6, -0.0, 0.999999, 1e-45]


@dataclass
class FuzzRequest:
    path: str  # /chat/completions or /completions
    body: bytes  # JSON text (ensure_ascii: a lone surrogate travels as its \\u escape)
    stream: bool


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_PIECES + ["a" * rng.randint(0, 300)]) for _ in range(rng.randint(0, 6)))


def _message(rng: random.Random) -> dict:
    role = rng.choice(["user", "user", "assistant", "system", "tool", "developer", "function", "bogus"])
    m: dict = {"role": role, "content": rng.choice([_text(rng), _text(rng), None, [{"type": "text", "text": _text(rng)}],
                                                    5, {"x": 1}])}
    if role == "assistant" and rng.random() < 0.4:
        m["tool_calls"] = [{"id": "c1", "type": "function", "function": {
            "name": rng.choice(["add", "", "x"]), "arguments": rng.choice(['{"a":1}', "not json", "", "{}"])}}]
    if role == "tool" and rng.random() < 0.5:
        m["tool_call_id"] = "c1"
    return m


def fuzz_requests(seed: int, count: int, *, vocab_size: int) -> list[FuzzRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        b: dict = {}
        chat = rng.random() < 0.75
        if chat:
            b["messages"] = [_message(rng) for _ in range(rng.randint(0, 5))]
            if rng.random() < 0.1:
                b["prompt_token_ids"] = [rng.randint(-2, vocab_size + 2) for _ in range(rng.randint(0, 5))]
            if rng.random() < 0.3:
                b["tools"] = [ADD_TOOL]
            if rng.random() < 0.2:
                b["tool_choice"] = rng.choice(["auto", "none", "required"])
            if rng.random() < 0.2:
                b["logprobs"] = True
        else:
            b["prompt"] = rng.choice([_text(rng), [rng.randint(0, vocab_size + 1) for _ in range(rng.randint(1, 5))],
                                      [_text(rng), _text(rng)], [[1, 2], [3]]])
        for k in ("temperature", "top_p", "top_k", "seed"):
            if rng.random() < 0.4:
                v = rng.choice(_NUMBERS)
                b[k] = v if k in ("temperature", "top_p") else rng.choice([int(min(abs(v), 2**63)), rng.randint(-5, 2**64)])
        if rng.random() < 0.3:
            b["n"] = rng.randint(1, 4)
        b["max_tokens"] = rng.randint(1, 8)
        if rng.random() < 0.2:
            b["stop"] = rng.choice([_text(rng) or "x", [_text(rng) or "y"], ["", "a"]])
        if rng.random() < 0.1:
            b["stop_token_ids"] = [rng.randint(-1, vocab_size + 10)]
        if rng.random() < 0.1:
            b["ignore_eos"] = True
        stream = rng.random() < 0.2
        if stream:
            b["stream"] = True
        out.append(FuzzRequest("/chat/completions" if chat else "/completions", json.dumps(b).encode(), stream))
    return out


def server_errors(status: int, text: str) -> bool:
    """A 5xx, or a stream that answered 200 and then carried a server error."""
    return status >= 500 or (status == 200 and '"type":"server_error"' in text.replace(" ", ""))
