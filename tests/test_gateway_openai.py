"""The gateway as an OpenAI server: a real uvicorn server on a loopback port, the official
``openai`` client (sync and async, streaming and not, with tools), and the recorded calls checked
token by token against the engine and a plain forward of the model."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch

from arborl.gateway.render import ChatRenderer, normalize_messages
from arborl.models import chat_token_ids
from arborl.types import GenerateRequest, SamplingParams
from helpers.blackbox_gateway import ADD_TOOL, ANSWER, script_messages, start_harness


@pytest.fixture(scope="module")
def h():
    harness = start_harness()
    yield harness
    harness.close()


def client(h, key, **kw):
    return openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=0, **kw)


def calls_of(h, sid):
    return h.pool.calls(sid)


@torch.no_grad()
def reference_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)]


def run_script(c, h, **kw):
    first, _, _ = script_messages()
    r1 = c.chat.completions.create(model=h.model, messages=first, tools=[ADD_TOOL], temperature=0,
                                   extra_body={"return_token_ids": True}, **kw)
    msg = r1.choices[0].message
    tool_msg = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}
    r2 = c.chat.completions.create(model=h.model, messages=first + [msg.model_dump(exclude_none=True), tool_msg],
                                   tools=[ADD_TOOL], temperature=0, extra_body={"return_token_ids": True}, **kw)
    return r1, r2


def test_tool_episode_is_recorded_token_for_token(h):
    sid, key = h.new_session(task_id="add-2-3", group_id="g1")
    r1, r2 = run_script(client(h, key), h)
    tc = r1.choices[0].message.tool_calls
    assert r1.choices[0].finish_reason == "tool_calls" and r1.choices[0].message.content is None
    assert tc[0].type == "function" and tc[0].function.name == "add" and json.loads(tc[0].function.arguments) == {"a": 2, "b": 3}
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert r1.policy_version == 0 and r1.choices[0].policy_version == 0

    c1, c2 = calls_of(h, sid)
    # the response's token ids are the recorded ones, and they are the engine's
    for resp, call in ((r1, c1), (r2, c2)):
        assert resp.prompt_token_ids == call.prompt_token_ids
        assert resp.choices[0].token_ids == call.completion_token_ids
        assert resp.choices[0].call_id == call.call_id
        ref = reference_logprobs(h.loaded.model, call.prompt_token_ids, call.completion_token_ids)
        assert torch.allclose(torch.tensor(call.logprobs), ref, atol=1e-4)
        assert call.versions == [0] * len(call.completion_token_ids) and call.engine_id == "engine-0"
    # the first prompt is the chat template's own tokenization of (tools block + question)
    r = ChatRenderer(h.loaded.tokenizer)
    first, _, _ = script_messages()
    plain = r.template_messages(normalize_messages(first), [ADD_TOOL])
    assert c1.prompt_token_ids == chat_token_ids(h.loaded.tokenizer, plain)
    # stitched: the second prompt is the first call's exact prompt + completion, then the tool turn
    full1 = c1.prompt_token_ids + c1.completion_token_ids
    assert c2.prompt_token_ids[: len(full1)] == full1
    assert c1.completion_token_ids[-1] == h.loaded.eos_token_ids[0]
    assert h.loaded.tokenizer.decode(c2.prompt_token_ids[len(full1):]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert c2.meta["stitch"]["parent_call"] == c1.call_id and c2.meta["stitch"]["retokenized_diff_at"] is None

    traj = h.get(f"/sessions/{sid}/trajectory", key).json()
    assert traj["task_id"] == "add-2-3" and traj["group_id"] == "g1" and traj["drift_events"] == []
    (sample,) = traj["samples"]
    assert sample["call_ids"] == [c1.call_id, c2.call_id]
    assert sample["token_ids"] == c2.prompt_token_ids + c2.completion_token_ids
    mask = sample["loss_mask"]
    generated = [t for t, m in zip(sample["token_ids"], mask) if m]
    assert generated == c1.completion_token_ids + c2.completion_token_ids  # exactly the engine's tokens
    assert sum(mask) == len(c1.completion_token_ids) + len(c2.completion_token_ids)
    assert sample["chunk_ids"][-1] == 1 and set(sample["chunk_ids"]) == {0, 1}


def test_recorded_tokens_equal_a_direct_engine_call(h):
    sid, key = h.new_session()
    resp = client(h, key).chat.completions.create(
        model=h.model, messages=[{"role": "user", "content": "Tell me a story."}], temperature=0, max_tokens=12,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    (call,) = calls_of(h, sid)
    async def direct():
        return await h.engines[0].generate(GenerateRequest(call.prompt_token_ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))

    res = asyncio.run(direct())
    assert res.token_ids == call.completion_token_ids == resp.choices[0].token_ids
    assert res.prompt_token_ids == call.prompt_token_ids
    assert resp.usage.prompt_tokens == len(call.prompt_token_ids) and resp.usage.completion_tokens == 12
    assert resp.choices[0].finish_reason == "length"


def test_async_client_streaming_equals_non_streaming(h):
    sid, key = h.new_session()
    ac = openai.AsyncOpenAI(base_url=h.base_url, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "Write a line."}]

    async def go():
        full = await ac.chat.completions.create(model=h.model, messages=msgs, temperature=0, max_tokens=20,
                                                extra_body={"return_token_ids": True, "ignore_eos": True})
        stream = await ac.chat.completions.create(model=h.model, messages=msgs, temperature=0, max_tokens=20, stream=True,
                                                  stream_options={"include_usage": True}, logprobs=True,
                                                  extra_body={"return_token_ids": True, "ignore_eos": True})
        chunks = [c async for c in stream]
        tool_stream = await ac.chat.completions.create(model=h.model, messages=script_messages()[0], tools=[ADD_TOOL],
                                                       temperature=0, stream=True)
        tool_chunks = [c async for c in tool_stream]
        await ac.close()
        return full, chunks, tool_chunks

    full, chunks, tool_chunks = asyncio.run(go())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
    assert ids == full.choices[0].token_ids
    assert chunks[0].prompt_token_ids == full.prompt_token_ids and chunks[0].choices[0].delta.role == "assistant"
    lps = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(lps) == 20
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # both calls recorded, the streamed one with the same tokens; logprobs are the recorded ones
    a, b, _ = calls_of(h, sid)
    assert a.completion_token_ids == b.completion_token_ids == ids
    assert lps == pytest.approx(b.logprobs, abs=1e-6)
    assert b.meta["reused_prompt_of"] == a.call_id  # same request again: same prompt tokens, a sibling sample
    # tool calls arrive in a delta, with finish_reason tool_calls
    deltas = [d for c in tool_chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "add" and json.loads(deltas[0].function.arguments) == {"a": 2, "b": 3}
    assert tool_chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in tool_chunks if c.choices) == ""
    assert tool_chunks[-1].usage.total_tokens > 0  # usage on the last chunk even without include_usage


def test_n_seed_logprobs_and_stop(h):
    sid, key = h.new_session()
    c = client(h, key)
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model=h.model, messages=msgs, n=3, seed=7, temperature=1.0, max_tokens=8, logprobs=True,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    again = c.chat.completions.create(model=h.model, messages=msgs, n=3, seed=7, temperature=1.0, max_tokens=8,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in r.choices] == [ch.token_ids for ch in again.choices]  # same seed, same tokens
    assert len({tuple(ch.token_ids) for ch in r.choices}) > 1  # choice i uses seed + i
    calls = calls_of(h, sid)
    assert len(calls) == 6 and [cl.meta["choice"] for cl in calls[:3]] == [0, 1, 2]
    for ch, cl in zip(r.choices, calls[:3]):
        assert ch.token_ids == cl.completion_token_ids
        assert [lp.logprob for lp in ch.logprobs.content] == pytest.approx(cl.logprobs, abs=1e-6)
    assert r.usage.completion_tokens == sum(len(ch.token_ids) for ch in r.choices)
    # a stop string: cut from the text, kept in the tokens (the policy produced them)
    first, _, _ = script_messages()
    s = c.chat.completions.create(model=h.model, messages=first, tools=[ADD_TOOL], temperature=0, stop=["arguments"],
                                  extra_body={"return_token_ids": True})
    assert s.choices[0].finish_reason == "stop" and s.choices[0].message.tool_calls is None
    # the cut tool call is malformed: it comes back as content and is counted on the call
    assert s.choices[0].message.content == '<tool_call>{"name": "add", "'
    assert "arguments" in h.loaded.tokenizer.decode(s.choices[0].token_ids)
    last = calls_of(h, sid)[-1]
    assert last.meta["malformed_tool_calls"] == 1 and "not valid JSON" in last.meta["tool_call_errors"][0]


def test_completions_endpoint_text_stitching_and_token_in(h):
    sid, key = h.new_session()
    c = client(h, key)
    r1 = c.completions.create(model=h.model, prompt="Hello", max_tokens=6, temperature=0,
                              extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == 6
    p2 = "Hello" + r1.choices[0].text + " and then"
    c.completions.create(model=h.model, prompt=p2, max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    c1, c2 = calls_of(h, sid)
    assert c2.meta["stitch"]["parent_call"] == c1.call_id
    assert c2.prompt_token_ids[: len(c1.prompt_token_ids) + 6] == c1.prompt_token_ids + c1.completion_token_ids
    # token in, token out
    ids = [1, 4093, 198, 6004]
    r3 = c.completions.create(model=h.model, prompt=ids, max_tokens=3, temperature=0,
                              extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r3.choices[0].prompt_token_ids == ids and len(r3.choices[0].token_ids) == 3
    chat = c.chat.completions.create(model=h.model, messages=[], max_tokens=3, temperature=0,
                                     extra_body={"prompt_token_ids": ids, "return_token_ids": True, "ignore_eos": True})
    assert chat.prompt_token_ids == ids and chat.choices[0].token_ids == r3.choices[0].token_ids
    # several prompts in one request: one choice each
    multi = c.completions.create(model=h.model, prompt=["a", "b"], max_tokens=2, temperature=0)
    assert [ch.index for ch in multi.choices] == [0, 1]
    assert len(calls_of(h, sid)) == 6
    # streaming completions
    text = "".join(ch.choices[0].text for ch in c.completions.create(model=h.model, prompt="Hello",
                                                                        max_tokens=6, temperature=0, stream=True,
                                                                        extra_body={"ignore_eos": True}))
    assert text == r1.choices[0].text


def test_models_and_unknown_model(h):
    sid, key = h.new_session()
    c = client(h, key)
    assert [m.id for m in c.models.list().data] == [h.model]
    assert c.models.retrieve(h.model).id == h.model
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert "this gateway serves 'scripted-tiny'" in e.value.message and e.value.body["code"] == "model_not_found"
    assert h.get("/models", "sk-nope").status_code == 401
    assert calls_of(h, sid) == []


def test_streaming_several_choices(h):
    sid, key = h.new_session()
    stream = client(h, key).chat.completions.create(
        model=h.model, messages=[{"role": "user", "content": "Two ways?"}], n=2, seed=3, max_tokens=6, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    text, ids, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in stream:
        for ch in chunk.choices:
            text[ch.index] += ch.delta.content or ""
            ids[ch.index] += getattr(ch, "token_ids", None) or []
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    calls = h.pool.calls(sid)
    assert finish == {0: "length", 1: "length"} and len(calls) == 2
    by_choice = {c.meta["choice"]: c for c in calls}
    for i in (0, 1):
        assert ids[i] == by_choice[i].completion_token_ids
        assert text[i] == h.loaded.tokenizer.decode(ids[i], skip_special_tokens=True)


def test_loopback_round_trips_are_not_delayed_by_nagle(h):
    """The listening socket is a TCP socket with TCP_NODELAY (accepted connections inherit it):
    responses written in two pieces (headers, body) must not wait for the client's delayed ACK
    (~40 ms each). The latency itself is measured by `arborl bench gateway`, not here."""
    import socket

    sock = h.server.socket
    assert sock.proto == socket.IPPROTO_TCP and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert h.http.get(h.server.url + "/health").status_code == 200
