"""Several engines behind one gateway (session affinity, load fallback), and many concurrent
sessions through the async openai client with nothing lost or mixed up."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from helpers.blackbox_gateway import ADD_TOOL, ANSWER, script_messages, start_harness


@pytest.fixture(scope="module")
def h():
    harness = start_harness(num_engines=2, affinity_max_load=1)
    yield harness
    harness.close()


def test_affinity_then_fallback_under_load(h):
    sid, key = h.new_session()
    c = openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=0)

    def ask(text):
        r = c.chat.completions.create(model=h.model, messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0)
        return h.pool.get_call(r.choices[0].call_id)

    first = [ask(f"q{i}") for i in range(3)]
    home = first[0].engine_id
    assert [x.engine_id for x in first] == [home] * 3  # affinity
    assert [x.meta["routing"] for x in first] == ["new", "affinity", "affinity"]
    home_idx = int(home.rsplit("-", 1)[1])

    # load the session's engine with a long request of the same session, then call again
    stop = threading.Event()

    def long_stream():
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", h.base_url + "/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    asyncio.run(h.engines[home_idx].pause())  # the long request stays in flight however fast the engine is
    t = threading.Thread(target=long_stream)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while h.engines[home_idx].load() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        moved = ask("while busy")
        assert moved.engine_id != home and moved.meta["routing"] == "fallback"
        # a new session starts on the least-loaded engine
        other_sid, other_key = h.new_session()
        openai.OpenAI(base_url=h.base_url, api_key=other_key, max_retries=0).chat.completions.create(
            model=h.model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert h.pool.calls(other_sid)[0].engine_id != home
    finally:
        stop.set()
        h.engines[home_idx].resume()
        t.join()
    assert h.gateway.engines.router.moves >= 1
    after = ask("after")
    assert after.engine_id == moved.engine_id and after.meta["routing"] == "affinity"  # affinity moved with the session


def test_concurrent_sessions_record_every_call_in_its_own_session(h):
    n_sessions = 24
    sessions = [h.new_session(task_id=f"t{i}") for i in range(n_sessions)]
    first, _, _ = script_messages()

    async def episode(key):
        c = openai.AsyncOpenAI(base_url=h.base_url, api_key=key, max_retries=0)
        try:
            r1 = await c.chat.completions.create(model=h.model, messages=first, tools=[ADD_TOOL], temperature=0)
            msg = r1.choices[0].message
            msgs = first + [msg.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}]
            r2 = await c.chat.completions.create(model=h.model, messages=msgs, tools=[ADD_TOOL], temperature=0)
            msgs += [r2.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "thanks"}]
            await c.chat.completions.create(model=h.model, messages=msgs, tools=[ADD_TOOL], temperature=0, max_tokens=3)
            return r2.choices[0].message.content
        finally:
            await c.close()

    async def run_all():
        return await asyncio.gather(*(episode(key) for _, key in sessions))

    answers = asyncio.run(run_all())
    assert answers == [ANSWER] * n_sessions
    for sid, key in sessions:
        traj = h.get(f"/sessions/{sid}/trajectory", key).json()
        assert len(traj["calls"]) == 3 and traj["drift_events"] == []
        (sample,) = traj["samples"]  # three stitched calls, one sample
        assert len(sample["call_ids"]) == 3
        assert all(c["prompt_token_ids"] == traj["calls"][0]["prompt_token_ids"][: len(c["prompt_token_ids"])]
                   or c["prompt_token_ids"][: len(traj["calls"][0]["prompt_token_ids"])] == traj["calls"][0]["prompt_token_ids"]
                   for c in traj["calls"])
    assert len({c.engine_id for sid, _ in sessions for c in h.pool.calls(sid)}) == 2  # both engines served


def test_policy_version_follows_weight_updates(h):
    sid, key = h.new_session()
    c = openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=0)
    state = {k: v.clone() for k, v in h.loaded.model.state_dict().items()}

    def ask():
        return c.chat.completions.create(model=h.model, messages=[{"role": "user", "content": "v?"}], max_tokens=2,
                                         extra_body={"ignore_eos": True})

    assert ask().policy_version == 0
    for e in h.engines:
        asyncio.run(e.update_weights(state, 3))
    try:
        r = ask()
        assert r.policy_version == 3 and r.choices[0].policy_version == 3
        assert h.pool.get_call(r.choices[0].call_id).versions == [3, 3]
        assert c.models.retrieve(h.model).model_extra["policy_version"] == 3
    finally:
        for e in h.engines:
            asyncio.run(e.update_weights(state, 0))


def test_a_shut_down_engine_is_skipped_after_one_retryable_503(h):
    sid, key = h.new_session()
    c = openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=0)
    first = c.chat.completions.create(model=h.model, messages=[{"role": "user", "content": "a"}], max_tokens=2)
    home = int(h.pool.get_call(first.choices[0].call_id).engine_id.rsplit("-", 1)[1])
    h.engines[home].shutdown()  # last test of the module: the harness shuts it down again, harmlessly
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model=h.model, messages=[{"role": "user", "content": "b"}], max_tokens=2)
    assert e.value.status_code == 503 and "is shut down; retry the call" in e.value.message
    # the official client retries 503s by itself; the call lands on the live engine, recorded once
    retrying = openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=2)
    r = retrying.chat.completions.create(model=h.model, messages=[{"role": "user", "content": "b"}], max_tokens=2)
    assert h.pool.get_call(r.choices[0].call_id).engine_id == f"engine-{1 - home}"
    assert len(h.pool.calls(sid)) == 2
    assert h.gateway.health()["engines"][home]["down"] is True
