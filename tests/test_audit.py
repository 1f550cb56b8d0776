"""`arborl audit`: every recorded chat call re-rendered with the chat template and compared with the ids
the engine consumed. A clean run (the scripted policy, whose tokens re-render to themselves) has no
drift; a planted template that re-renders a tool call with other spacing is found at the tool call,
stitched (faithful) with stitching on and unfaithful with it off; the step metrics carry the drift
count, and gateway.max_drift_rate stops a run."""

from __future__ import annotations

import copy
import json
import subprocess

import openai
import pytest

from arborl.gateway.audit import audit_episodes, call_drifted
from arborl.gateway.render import ChatRenderer
from arborl.run.job import TokenDriftError, train

from helpers.blackbox_gateway import ADD_TOOL, TOOL_CALL_TEXT, script_messages, start_harness
from helpers.echo_env import echo_env
from helpers.tiny_run import ENV, arborl_cmd, tiny_cfg


@pytest.fixture(scope="module")
def h():
    harness = start_harness()
    yield harness
    harness.close()


def _episode(h, stitching: bool) -> str:
    """The scripted tool-use episode over HTTP: the tool call, then the answer; returns the session id."""
    sid, key = h.new_session(stitching=stitching)
    c = openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=0)
    first, _, tool = script_messages()
    r1 = c.chat.completions.create(model=h.model, messages=first, tools=[ADD_TOOL], temperature=0)
    reply = r1.choices[0].message.model_dump(exclude_none=True)
    msgs = first + [reply, {**tool, "tool_call_id": reply["tool_calls"][0]["id"]}]
    c.chat.completions.create(model=h.model, messages=msgs, tools=[ADD_TOOL], temperature=0, max_tokens=4)
    return sid


def _planted(tokenizer):
    """The same chat template, except that assistant turns are re-rendered with `": ` written `":`."""
    t = copy.deepcopy(tokenizer)
    t.chat_template = tokenizer.chat_template.replace(
        "message['content'] + '<|im_end|>'",
        "(message['content'] | replace('\": ', '\":') if message['role'] == 'assistant' else message['content'])"
        " + '<|im_end|>'")
    assert t.chat_template != tokenizer.chat_template
    return t


def _audit(h, renderer, sid):
    return audit_episodes(renderer, [h.pool.get_episode(sid)])


def test_a_clean_run_has_no_drift(h):
    sid = _episode(h, stitching=True)
    report = _audit(h, ChatRenderer(h.loaded.tokenizer), sid)
    assert (report.calls, report.audited, report.drift_calls, report.unfaithful_calls) == (2, 2, 0, 0)
    assert not any(call_drifted(c) for c in h.pool.get_episode(sid).calls)


def test_a_template_that_re_renders_the_tool_call_is_found_at_the_tool_call(h):
    tok = h.loaded.tokenizer
    planted = ChatRenderer(_planted(tok))
    original = h.gateway.renderer
    h.gateway.renderer = planted  # the gateway serves with the planted template too
    try:
        stitched_sid, plain_sid = _episode(h, stitching=True), _episode(h, stitching=False)
    finally:
        h.gateway.renderer = original
    for sid, stitching in ((stitched_sid, True), (plain_sid, False)):
        ep = h.pool.get_episode(sid)
        report = _audit(h, planted, sid)
        assert (report.audited, report.drift_calls) == (2, 1), report.summary()
        (ex,) = report.examples
        assert ex.call_id == ep.calls[1].call_id and ex.stitched is stitching and ex.unfaithful is not stitching
        assert report.unfaithful_reasons == ({} if stitching else {"stitching_off": 1})
        assert report.retokenized_calls == (1 if stitching else 0)  # stitched: its prompt is not the re-render
        c1 = ep.calls[0]
        # the first difference is inside the first call's tool call: the engine has the policy's `": `
        assert len(c1.prompt_token_ids) <= ex.position < len(c1.prompt_token_ids) + len(c1.completion_token_ids)
        assert '": ' in tok.decode(ex.engine_ids) and '": ' not in tok.decode(ex.rerender_ids)
        assert TOOL_CALL_TEXT in tok.decode(ep.calls[1].prompt_token_ids) or not stitching
        assert call_drifted(ep.calls[1]) and not call_drifted(ep.calls[0])  # what the step metric counts


def test_unrecorded_requests_are_counted_not_audited(tmp_path):
    harness = start_harness(record_messages=False)
    try:
        sid = _episode(harness, stitching=True)
        report = _audit(harness, ChatRenderer(harness.loaded.tokenizer), sid)
        assert (report.calls, report.audited, report.not_recorded) == (2, 0, 2)
    finally:
        harness.close()


def test_the_cli_audits_a_run_and_agrees_with_the_step_metrics(tmp_path):
    cfg = tiny_cfg(tmp_path, "audited", "rollout.task=gym", f"rollout.gym.env={echo_env(tmp_path)}",
                   "rollout.max_turns=3", "rollout.steps=1", "rollout.batch_tasks=2", "rollout.group_size=2",
                   "rollout.max_tokens=6")
    train(cfg)
    steps = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if '"kind": "step"' in x]
    r = subprocess.run(arborl_cmd("audit", str(cfg.run_dir), "--max-drift-rate", "1"), capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["calls"] == out["audited"] == steps[0]["calls"] == 12  # 2 x 2 episodes x 3 turns, all recorded
    assert out["drift_calls"] == steps[0]["drift_calls"]  # the offline re-render agrees with the live count
    assert out["unfaithful_calls"] == 0  # stitching on: every call extends the tokens the policy produced
    strict = subprocess.run(arborl_cmd("audit", str(cfg.run_dir), "--max-drift-rate", "0"), capture_output=True,
                            text=True, env=ENV, timeout=300)
    assert strict.returncode == (1 if out["drift_calls"] else 0)
    bad = subprocess.run(arborl_cmd("audit", str(tmp_path)), capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode != 0 and "not a run directory" in bad.stderr


@pytest.mark.parametrize("bound", [0.0, 1.0])
def test_max_drift_rate_stops_a_drifting_run_with_a_checkpoint(tmp_path, bound):
    """Multi-turn episodes of a random tiny model with stitching off: its replies, re-rendered as text,
    are not its tokens, so later calls drift; a bound of 0 stops the run after its first step, 1 never."""
    cfg = tiny_cfg(tmp_path, f"drifting{bound}", "rollout.task=gym", f"rollout.gym.env={echo_env(tmp_path)}",
                   "rollout.max_turns=3", "rollout.steps=2", "rollout.batch_tasks=2", "rollout.group_size=2",
                   "rollout.max_tokens=6", "gateway.stitching=false", f"gateway.max_drift_rate={bound}")
    if bound == 1.0:
        assert train(cfg)["steps"] == 2
        return
    with pytest.raises(TokenDriftError, match=r"after step 1: \d+ of 12 calls drifted .* > gateway.max_drift_rate=0.0.*arborl audit"):
        train(cfg)
    assert (cfg.run_dir / "checkpoint").is_dir()
