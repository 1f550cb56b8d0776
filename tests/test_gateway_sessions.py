"""Sessions over HTTP: keys and isolation, rewards / finish / trajectory, drift, stitching off,
bad input (4xx that says what to fix), engine failure (5xx, nothing recorded, session usable),
and a client that disconnects mid-request (the engine request is aborted)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from arborl.gateway.render import ChatRenderer, normalize_messages
from arborl.gateway.stitching import common_prefix_len
from arborl.types import EpisodeStatus
from helpers.blackbox_gateway import ADD_TOOL, ADMIN_KEY, script_messages, start_harness


@pytest.fixture(scope="module")
def h():
    harness = start_harness(faults=True)
    yield harness
    harness.close()


def client(h, key, retries=0):
    return openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=retries)


def chat(h, key, messages=None, **kw):
    kw.setdefault("temperature", 0)
    return client(h, key).chat.completions.create(model=h.model, messages=messages or [{"role": "user", "content": "hi"}], **kw)


def wait_for(pred, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = pred()
        if out:
            return out
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


# ------------------------------------------------------------------ keys


def test_keys_isolate_sessions(h):
    a_id, a_key = h.new_session(task_id="a")
    b_id, b_key = h.new_session(task_id="b")
    chat(h, a_key, max_tokens=3)
    chat(h, b_key, max_tokens=3)
    # no key, a wrong key, the admin key: no model call
    for key in (None, "sk-arborl-wrong", ADMIN_KEY):
        r = h.post("/chat/completions", key, json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    assert "admin key creates sessions" in h.post("/chat/completions", ADMIN_KEY, json={}).json()["error"]["message"]
    # a session's key cannot read or write another session, whether it exists or not
    for path in (f"/sessions/{b_id}/trajectory", f"/sessions/{b_id}", "/sessions/ep-doesnotexist/trajectory"):
        assert h.get(path, a_key).status_code == 401
    for path, body in ((f"/sessions/{b_id}/reward", {"value": 1}), (f"/sessions/{b_id}/finish", {})):
        assert h.post(path, a_key, json=body).status_code == 401
    assert h.post(f"/sessions/{b_id}/finish", ADMIN_KEY, json={}).status_code == 401
    # only the admin key creates sessions
    assert h.post("/sessions", a_key, json={}).status_code == 401
    assert h.post("/sessions", None, json={}).status_code == 401
    # each trajectory holds its own calls only
    ta, tb = h.get(f"/sessions/{a_id}/trajectory", a_key).json(), h.get(f"/sessions/{b_id}/trajectory", b_key).json()
    assert len(ta["calls"]) == len(tb["calls"]) == 1
    assert {c["call_id"] for c in ta["calls"]}.isdisjoint(c["call_id"] for c in tb["calls"])
    assert ta["task_id"] == "a" and tb["task_id"] == "b"
    assert h.get(f"/sessions/{b_id}", b_key).json()["calls"] == 1


def test_rewards_finish_and_trajectory(h):
    s = h.new_session_keys(task_id="t", group_id="g", metadata={"difficulty": 2})
    sid, key, harness = s["session_id"], s["api_key"], s["harness_key"]
    other_sid, other_key = h.new_session()
    r = chat(h, key, max_tokens=3)
    other = chat(h, other_key, max_tokens=3)
    call_id = r.choices[0].call_id
    ok = h.post(f"/sessions/{sid}/reward", harness, json={"value": 0.5, "name": "format", "call_id": call_id})
    assert ok.status_code == 200 and ok.json()["call_id"] == call_id
    assert h.post(f"/sessions/{sid}/reward", harness, json={"value": -1}).status_code == 200
    bad = h.post(f"/sessions/{sid}/reward", harness, json={"value": 1, "call_id": other.choices[0].call_id})
    assert bad.status_code == 404 and "not a call of this session" in bad.json()["error"]["message"]
    nan = h.post(f"/sessions/{sid}/reward", harness, content=b'{"value": NaN}')
    assert nan.status_code == 400 and "value" in nan.json()["error"]["message"]
    missing = h.post(f"/sessions/{sid}/reward", harness, json={"name": "x"})
    assert missing.status_code == 400 and "value: required field is missing" in missing.json()["error"]["message"]
    assert h.post(f"/sessions/{other_sid}/reward", harness, json={"value": 1}).status_code == 401  # its session only

    done = h.post(f"/sessions/{sid}/finish", key, json={})
    assert done.json() == {"session_id": sid, "status": "finished", "calls": 1}
    with pytest.raises(openai.ConflictError, match="is finished: it takes no more model calls"):
        chat(h, key, max_tokens=3)
    traj = h.get(f"/sessions/{sid}/trajectory", key).json()
    assert traj["status"] == "finished" and len(traj["calls"]) == 1
    assert [(x["name"], x["value"], x["call_id"]) for x in traj["rewards"]] == [("format", 0.5, call_id), ("agent", -1.0, None)]
    ep = h.pool.get_episode(sid)
    assert ep.status == EpisodeStatus.FINISHED and ep.finished_at is not None
    assert ep.meta["difficulty"] == 2 and len(ep.meta["rewards"]) == 2 and ep.group_id == "g"
    assert h.post(f"/sessions/{other_sid}/finish", other_key, json={"status": "failed"}).json()["status"] == "failed"
    assert h.pool.get_episode(other_sid).status == EpisodeStatus.FAILED
    assert h.post(f"/sessions/{other_sid}/finish", other_key, json={"status": "won"}).status_code == 400


def test_an_untrusted_agent_cannot_reward_itself_and_the_harness_can(h):
    """rollout.trust_agent_rewards=false (the default): the agent's own key gets 403 on its reward route;
    the harness key and the admin key (the task's scorer) post; a trusting gateway lets the agent key post."""
    s = h.new_session_keys(task_id="t")
    sid, agent_key = s["session_id"], s["api_key"]
    refused = h.post(f"/sessions/{sid}/reward", agent_key, json={"value": 1, "name": "self"})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_denied_error"
    assert "rollout.trust_agent_rewards" in refused.json()["error"]["message"]
    assert h.post(f"/sessions/{sid}/reward", s["harness_key"], json={"value": 0.5, "name": "harness"}).status_code == 200
    assert h.post(f"/sessions/{sid}/reward", ADMIN_KEY, json={"value": 0.25, "name": "scorer"}).status_code == 200
    assert h.post("/sessions/ep-doesnotexist/reward", ADMIN_KEY, json={"value": 1}).status_code == 404
    rewards = h.get(f"/sessions/{sid}/trajectory", agent_key).json()["rewards"]
    assert [(x["name"], x["value"]) for x in rewards] == [("harness", 0.5), ("scorer", 0.25)]
    h.gateway.trust_agent_rewards = True
    try:
        trusted_id, trusted_key = h.new_session()
    finally:
        h.gateway.trust_agent_rewards = False
    assert h.post(f"/sessions/{trusted_id}/reward", trusted_key, json={"value": 1, "name": "self"}).status_code == 200
    assert h.post(f"/sessions/{sid}/reward", agent_key, json={"value": 1}).status_code == 403  # unchanged for the old one


def test_rollout_trust_agent_rewards_reaches_the_gateways_sessions(tmp_path):
    """The knob, through build_gateway: off, a session's agent key is refused its own reward; on, it posts."""
    from arborl.run.assemble import build_gateway
    from arborl.config import load_config
    from arborl.gateway import PermissionDeniedError

    for trusted in (False, True):
        cfg = load_config(None, [f"runs_dir={tmp_path}", f"name=trust-{trusted}", "model.source=tiny",
                                 "model.tiny_layers=1", "model.tiny_hidden=32", "engine.max_seq_len=64",
                                 f"rollout.trust_agent_rewards={str(trusted).lower()}"])
        built = build_gateway(cfg)
        try:
            info = asyncio.run(built.gateway.create_session(task_id="t"))
            assert built.gateway.sessions.for_reward(info.harness_key, info.session_id) is info.session
            if trusted:
                assert built.gateway.sessions.for_reward(info.api_key, info.session_id) is info.session
            else:
                with pytest.raises(PermissionDeniedError, match="rollout.trust_agent_rewards"):
                    built.gateway.sessions.for_reward(info.api_key, info.session_id)
        finally:
            built.close()


def test_a_rollout_workers_client_posts_rewards_with_the_harness_key(h):
    """HttpSessionClient (a rollout worker's white-box agent loop) posts with the harness key it is given;
    with the agent key alone it is refused like any agent program."""
    from arborl.agents.http_client import GatewayHTTPError, HttpSessionClient

    s = h.new_session_keys(task_id="w")

    async def go(harness_key):
        client = HttpSessionClient(h.base_url, s["session_id"], s["api_key"], h.model, harness_key=harness_key)
        try:
            await client.reward(0.5, name="tool_error")
        finally:
            await client.aclose()

    asyncio.run(go(s["harness_key"]))
    with pytest.raises(GatewayHTTPError, match="HTTP 403"):
        asyncio.run(go(None))
    assert [x["name"] for x in h.gateway.sessions.get(s["session_id"]).episode.meta["rewards"]] == ["tool_error"]


# ------------------------------------------------------------------ drift and stitching off


def test_edited_history_is_a_drift_event_and_a_separate_sample(h):
    sid, key = h.new_session()
    first, _, _ = script_messages()
    r1 = chat(h, key, first, tools=[ADD_TOOL])
    msg = r1.choices[0].message.model_dump(exclude_none=True)
    msg["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": 4}'  # the agent rewrote the model's call
    chat(h, key, first + [msg, {"role": "tool", "tool_call_id": "x", "content": "6"}], tools=[ADD_TOOL], max_tokens=4)
    c1, c2 = h.pool.calls(sid)
    ev = c2.meta["drift"]
    assert ev["reason"] == "assistant_message_edited" and ev["message_index"] == 1 and ev["against_call"] == c1.call_id
    full1 = c1.prompt_token_ids + c1.completion_token_ids
    assert ev["position"] == common_prefix_len(c2.prompt_token_ids, full1)
    assert len(c1.prompt_token_ids) < ev["position"] < len(full1)  # inside the model's own reply
    assert c2.prompt_token_ids[ev["position"]] != full1[ev["position"]]
    traj = h.get(f"/sessions/{sid}/trajectory", key).json()
    assert [s["call_ids"] for s in traj["samples"]] == [[c1.call_id], [c2.call_id]]
    assert traj["drift_events"] == [{"call_id": c2.call_id, **ev}]
    assert traj["samples"][1]["drift_events"][0]["position"] == ev["position"]


def test_stitching_on_keeps_the_real_tokens_and_off_serves_the_template(h):
    """A stop string cuts the reply's text but not its tokens. Stitching on: the next prompt holds
    the tokens the policy produced (one sample; the diagnostic shows where a re-render would differ).
    Stitching off: the template's rendering of the cut text, recorded as a drift (two samples)."""
    first, _, _ = script_messages()
    out = {}
    for stitching in (True, False):
        sid, key = h.new_session(stitching=stitching)
        r1 = chat(h, key, first, tools=[ADD_TOOL], stop=["arguments"])
        reply = r1.choices[0].message.model_dump(exclude_none=True)
        msgs2 = first + [reply, {"role": "user", "content": "continue"}]
        chat(h, key, msgs2, tools=[ADD_TOOL], max_tokens=3)
        c1, c2 = h.pool.calls(sid)
        samples = h.get(f"/sessions/{sid}/trajectory", key).json()["samples"]
        out[stitching] = (c1, c2, samples, msgs2)
    c1, c2, samples, _ = out[True]
    full1 = c1.prompt_token_ids + c1.completion_token_ids
    assert c2.prompt_token_ids[: len(full1)] == full1 and len(samples) == 1
    assert len(c1.prompt_token_ids) <= c2.meta["stitch"]["retokenized_diff_at"] < len(full1)
    c1, c2, samples, msgs2 = out[False]
    r = ChatRenderer(h.loaded.tokenizer)
    assert c2.prompt_token_ids == r.encode(r.render(normalize_messages(msgs2), [ADD_TOOL], add_generation_prompt=True))
    ev = c2.meta["drift"]
    assert ev["reason"] == "stitching_off" and len(samples) == 2 and "stitch" not in c2.meta
    assert ev["position"] == common_prefix_len(c2.prompt_token_ids, c1.prompt_token_ids + c1.completion_token_ids)


# ------------------------------------------------------------------ bad input


def test_bad_input_is_a_4xx_that_says_what_to_fix(h):
    sid, key = h.new_session()
    cases = [
        (b"{not json", 400, "not valid JSON at line 1 column 2"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b"", 400, "body is empty"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), 400, "temperature: "),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}).encode(), 400,
         "unsupported parameter(s): frequency_penalty. Remove them, or start the gateway with gateway.unsupported_params=ignore"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 99}).encode(), 400, "at most 16 choices (gateway.max_n)"),
        (json.dumps({"model": "scripted-tiny"}).encode(), 400, "messages is required"),
        (json.dumps({"messages": [{"role": "pirate", "content": "x"}]}).encode(), 400, "messages[0].role is 'pirate'"),
        (json.dumps({"prompt_token_ids": [1, 99999]}).encode(), 400, "outside [0, 49152)"),
        (json.dumps({"prompt_token_ids": [5] * 2048}).encode(), 400, "the prompt has 2048 tokens but the model's context holds 2048"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "llama-70b"}).encode(), 404, "does not exist"),
    ]
    for raw, status, fragment in cases:
        r = h.post("/chat/completions", key, content=raw)
        assert r.status_code == status, (raw, r.text)
        err = r.json()["error"]
        assert fragment in err["message"], (fragment, err["message"])
        assert err["type"] in ("invalid_request_error", "not_found_error")
    long = h.post("/chat/completions", key, json={"messages": [{"role": "user", "content": "word " * 2100}], "stream": True})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert h.get("/nope", key).status_code == 404 and "no route GET /v1/nope" in h.get("/nope", key).json()["error"]["message"]
    # the official client surfaces the message; the session is still fine afterwards
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(h, key, logprobs=True, top_logprobs=3)
    assert chat(h, key, max_tokens=2).choices[0].message is not None
    assert len(h.pool.calls(sid)) == 1


def test_ignored_unsupported_params_are_noted_on_the_call(h):
    h.gateway.config.unsupported_params = "ignore"
    try:
        sid, key = h.new_session()
        chat(h, key, max_tokens=2, presence_penalty=1.0, logit_bias={"5": 3})
    finally:
        h.gateway.config.unsupported_params = "reject"
    assert h.pool.calls(sid)[0].meta["ignored_params"] == ["presence_penalty", "logit_bias"]


# ------------------------------------------------------------------ engine failure


def test_engine_failure_is_a_500_for_that_call_only(h):
    sid, key = h.new_session()
    h.faults.armed = True
    with pytest.raises(openai.InternalServerError, match="the engine failed while serving this call.*retry the call"):
        chat(h, key, max_tokens=4)
    assert h.pool.calls(sid) == []  # nothing recorded
    assert chat(h, key, max_tokens=4).choices[0].message is not None  # the session and engine still serve
    assert len(h.pool.calls(sid)) == 1
    # the client's automatic retry after a 500 records the call once
    h.faults.armed = True
    fired = h.faults.fired
    r = client(h, key, retries=2).chat.completions.create(model=h.model, messages=[{"role": "user", "content": "again"}],
                                                          max_tokens=4, temperature=0)
    assert h.faults.fired == fired + 1 and len(h.pool.calls(sid)) == 2 and h.pool.calls(sid)[-1].call_id == r.choices[0].call_id
    # a failure while streaming: an error event, nothing recorded
    h.faults.armed = True
    with pytest.raises(openai.APIError, match="the engine failed"):
        for _ in chat(h, key, max_tokens=4, stream=True):
            pass
    assert len(h.pool.calls(sid)) == 2
    assert h.gateway.stats.errors_5xx >= 3


# ------------------------------------------------------------------ disconnects


def _aborted_call(h, sid):
    calls = h.pool.calls(sid)
    return calls[0] if calls and calls[0].finish_reason == "abort" else None


def test_client_disconnect_mid_stream_aborts_the_engine_request(h):
    sid, key = h.new_session()
    aborted_before = asyncio.run(h.engines[0].stats())["aborted"]
    body = {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 1900, "ignore_eos": True,
            "stream": True, "temperature": 0}
    got = 0
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", h.base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 5:
                    break  # leaving the block closes the connection mid-stream
    call = wait_for(lambda: _aborted_call(h, sid))
    assert 4 <= len(call.completion_token_ids) < 1900
    assert call.meta["client_disconnected"] is True
    wait_for(lambda: h.engines[0].load() == 0)
    assert asyncio.run(h.engines[0].stats())["aborted"] == aborted_before + 1
    # an aborted call is kept in the data pool but is not a training sample
    assert h.get(f"/sessions/{sid}/trajectory", key).json()["samples"] == []


def test_client_disconnect_while_waiting_aborts_too(h):
    sid, key = h.new_session()
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(h.base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=0.5)
    call = wait_for(lambda: _aborted_call(h, sid))
    assert len(call.completion_token_ids) < 1900 and call.meta["client_disconnected"] is True
