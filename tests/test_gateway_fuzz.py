"""Fuzzed OpenAI bodies on a live gateway (uvicorn, real engine, SmolLM2's tokenizer): every body gets
a 2xx or a 4xx naming what to fix, never a 5xx, and the server keeps serving. The bodies come from the
fault bench's generator (benchmarks/arborl_bench/openai_fuzz.py), a fixed seed."""

from __future__ import annotations

import collections

import pytest

from arborl_bench.openai_fuzz import fuzz_requests, server_errors
from helpers.blackbox_gateway import QUESTION, start_harness


@pytest.fixture(scope="module")
def harness():
    h = start_harness()
    yield h
    h.close()


def test_fuzzed_bodies_get_no_5xx_and_the_server_keeps_serving(harness):
    statuses: collections.Counter = collections.Counter()
    bad = []
    sid, key = harness.new_session()
    for i, req in enumerate(fuzz_requests(11, 150, vocab_size=harness.loaded.vocab_size)):
        if i % 25 == 0:
            sid, key = harness.new_session()
        r = harness.post(req.path, key, content=req.body)
        statuses[r.status_code] += 1
        if server_errors(r.status_code, r.text) or r.status_code not in (200, 400):
            bad.append((r.status_code, req.body[:300], r.text[:300]))
    assert not bad, bad
    assert statuses[200] >= 20 and statuses[400] >= 20  # the bodies reach the engine, and bad ones are refused
    r = harness.post("/chat/completions", key, json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_is_a_400_naming_where_it_is(harness):
    sid, key = harness.new_session()
    body = b'{"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "a\\ud800b"}], "max_tokens": 2}'
    r = harness.post("/chat/completions", key, content=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[1].content" and "unpaired UTF-16 surrogate" in err["message"]
    # a surrogate pair is one character, and fine
    ok = b'{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], "max_tokens": 2}'
    assert harness.post("/chat/completions", key, content=ok).status_code == 200


def test_extreme_sampling_values_are_served_or_refused_by_name(harness):
    sid, key = harness.new_session()
    msgs = [{"role": "user", "content": QUESTION}]
    greedy = harness.post("/chat/completions", key, json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                          "return_token_ids": True})
    tiny = harness.post("/chat/completions", key, json={"messages": msgs, "max_tokens": 6, "temperature": 1e-45,
                                                        "return_token_ids": True, "top_k": 2**63})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    r = harness.post("/chat/completions", key, content=b'{"messages": [{"role": "user", "content": "x"}], '
                                                        b'"temperature": Infinity}')
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
