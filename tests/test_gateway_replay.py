"""A session created with ``replay`` (the recorded calls of an episode a kill cut short) serves a request
whose prompt is exactly the next recorded prompt from the record -- the same tokens, log-probs and
versions, no decoding -- records it again with ``replayed_from``, and decodes as usual from the first
request that differs (the rest of the replay is dropped). Live gateway, real engine, scripted policy."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.blackbox_gateway import ADD_TOOL, script_messages, start_harness


@pytest.fixture(scope="module")
def harness():
    h = start_harness()
    yield h
    h.close()


def _turn(harness, key, messages, stream=False):
    body = {"messages": messages, "tools": [ADD_TOOL], "temperature": 0, "max_tokens": 32, "return_token_ids": True,
            "stream": stream}
    r = harness.post("/chat/completions", key, json=body)
    assert r.status_code == 200, r.text
    return r


def test_a_replayed_session_serves_its_recorded_calls_then_decodes(harness):
    first, reply, tool = script_messages()
    sid, key = harness.new_session()
    a = _turn(harness, key, first).json()
    b = _turn(harness, key, first + [reply, tool]).json()
    recorded = harness.pool.calls(sid)
    assert len(recorded) == 2

    async def new(replay):
        return await harness.gateway.create_session(task_id="t", replay=replay)

    info = asyncio.run(new(recorded))
    key2 = info.api_key
    before = harness.gateway.stats.replayed_tokens
    a2 = _turn(harness, key2, first).json()
    streamed = _turn(harness, key2, first + [reply, tool], stream=True).text
    assert a2["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
    assert '"error"' not in streamed and streamed.rstrip().endswith("data: [DONE]")
    deltas = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    text = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d.get("choices"))
    assert text == b["choices"][0]["message"]["content"] == "The answer is 5."
    again = harness.pool.calls(info.session_id)
    assert [c.meta.get("replayed_from") for c in again] == [c.call_id for c in recorded]
    assert [c.engine_id for c in again] == ["replay", "replay"]
    for old, new_call in zip(recorded, again):
        assert (new_call.completion_token_ids, new_call.logprobs, new_call.versions) == \
               (old.completion_token_ids, old.logprobs, old.versions)
    assert harness.gateway.stats.replayed_tokens - before == sum(len(c.completion_token_ids) for c in recorded)

    # a request that differs from the record ends the replay: decoded by the engine from there on
    info3 = asyncio.run(new(recorded))
    _turn(harness, info3.api_key, [{"role": "user", "content": "something else"}])
    _turn(harness, info3.api_key, first)
    assert [c.meta.get("replayed_from") for c in harness.pool.calls(info3.session_id)] == [None, None]
