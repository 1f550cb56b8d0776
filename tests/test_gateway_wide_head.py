"""A model whose LM head is wider than its tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens) samples
ids the tokenizer has no text for. The gateway serves them: the call is recorded with those ids, their
text is empty, streaming and the next turn work, and such an id sent back as a prompt token is valid
(it is a row of the model). Here a tiny random model with SmolLM2's tokenizer and 40,000 extra rows,
sampled at temperature 1, draws them on almost every other token."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.tiny_run import tiny_cfg  # noqa: E402

from arborl.gateway.server import GatewayServer  # noqa: E402
from arborl.run.assemble import build_gateway  # noqa: E402

EXTRA = 40_000


@pytest.fixture
def served(tmp_path):
    built = build_gateway(tiny_cfg(tmp_path, "wide", f"model.tiny_vocab={49152 + EXTRA}", "gateway.admin_key=adm"),
                          run_dir=tmp_path / "wide")
    server = GatewayServer(built.gateway).start()
    http = httpx.Client(timeout=60)
    try:
        yield built, server, http
    finally:
        http.close()
        server.stop()
        built.close()


def test_ids_past_the_tokenizer_are_served_recorded_and_sent_back(served):
    built, server, http = served
    tokenizer_ids = len(built.loaded.tokenizer)
    assert built.loaded.vocab_size == tokenizer_ids + EXTRA
    r = http.post(server.base_url + "/sessions", json={}, headers={"Authorization": "Bearer adm"})
    key = r.json()["api_key"]
    auth = {"Authorization": f"Bearer {key}"}
    messages = [{"role": "user", "content": "hi"}]
    past = 0
    for turn in range(3):
        body = {"messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": turn, "return_token_ids": True,
                "n": 2}
        r = http.post(server.base_url + "/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        past += sum(t >= tokenizer_ids for c in r.json()["choices"] for t in c["token_ids"])
        messages = messages + [choice["message"], {"role": "user", "content": "more"}]
    with http.stream("POST", server.base_url + "/chat/completions", headers=auth,
                     json={"messages": messages, "max_tokens": 12, "temperature": 1.0, "stream": True}) as s:
        streamed = "".join(s.iter_text())
    assert s.status_code == 200 and streamed.rstrip().endswith("data: [DONE]") and '"error"' not in streamed
    assert past > 0  # the model did draw ids the tokenizer has no text for
    r = http.post(server.base_url + "/completions", headers=auth,
                  json={"prompt": [1, 2, tokenizer_ids + 5, 3], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    r = http.post(server.base_url + "/completions", headers=auth,
                  json={"prompt": [1, built.loaded.vocab_size], "max_tokens": 4})
    assert r.status_code == 400 and f"outside [0, {built.loaded.vocab_size})" in r.json()["error"]["message"]
    assert built.gateway.stats.calls_recorded >= 8
