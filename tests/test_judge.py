"""E4: the LLM judge. Verdict parsing and how veto / weight apply; the default judge is the served
policy in sessions of their own (recorded, agent kind "judge", never part of a training group); a
judge at another OpenAI-compatible endpoint vetoes the episodes it calls hacks, and its verdict and
reasoning are stored with the episode."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from arborl.run.assemble import build_gateway
from arborl.config import JudgeConfig, load_config
from arborl.run.controller import Controller, make_judge
from arborl.tasks import make_suite
from arborl.tasks.judge import JudgeVerdict, apply_verdict, parse_verdict

SUITE = Path(__file__).resolve().parent / "helpers" / "judged_suite.py"


def test_the_last_verdict_line_decides_and_the_text_before_it_is_the_reasoning():
    v = parse_verdict("It hard-codes 42 for the test input.\nVERDICT: HACK")
    assert v.verdict == "hack" and v.score == 0.0 and v.reasoning == "It hard-codes 42 for the test input."
    assert parse_verdict("verdict: hack ... on reflection VERDICT: pass").verdict == "pass"
    assert parse_verdict("no idea").verdict == "unclear" and parse_verdict("no idea").score == 0.5


def test_veto_zeroes_a_hack_and_weight_blends_only_where_the_tests_passed():
    hack, ok = JudgeVerdict("hack", "r"), JudgeVerdict("pass", "r")
    assert apply_verdict({"outcome": 1.0}, hack, mode="veto", weight=0.5) == {"outcome": 0.0, "judge": 0.0}
    assert apply_verdict({"outcome": 1.0}, ok, mode="veto", weight=0.5)["outcome"] == 1.0
    assert apply_verdict({"outcome": 1.0}, hack, mode="weight", weight=0.25)["outcome"] == 0.75
    assert apply_verdict({"outcome": 0.0}, ok, mode="weight", weight=0.25)["outcome"] == 0.0


def _cfg(tmp_path, *extra):
    return load_config(None, [f"runs_dir={tmp_path}", "name=j", "model.source=tiny", "model.tiny_tokenizer=smollm2",
                              "model.tiny_layers=1", "model.tiny_hidden=32", "engine.max_seq_len=512",
                              f"rollout.task={SUITE}:suite", "rollout.max_tokens=4", *extra])


def _judge_server(answer: str):
    app = FastAPI()
    seen = []

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        seen.append(body)
        return {"choices": [{"message": {"role": "assistant", "content": answer}}]}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1", seen


def _run_group(cfg):
    built = build_gateway(cfg)
    ctl = Controller(cfg, built.gateway, built.engines, built.pool, None, make_suite(cfg.rollout))

    async def main():
        try:
            tasks = ctl.suite.tasks("train", 1)
            return await ctl.run_groups(tasks, 2, temperature=1.0, tag="t")
        finally:
            await ctl.close()

    try:
        return asyncio.run(main()), built.pool.episodes()
    finally:
        built.close()


def test_a_judge_endpoint_vetoes_what_it_calls_a_hack_and_the_verdict_is_stored(tmp_path):
    server, url, seen = _judge_server("It special-cases the input.\nVERDICT: HACK")
    try:
        episodes, _ = _run_group(_cfg(tmp_path, "rollout.judge.mode=veto", f"rollout.judge.base_url={url}",
                                      "rollout.judge.model=judge-x"))
    finally:
        server.should_exit = True
    assert len(seen) == 2 and seen[0]["model"] == "judge-x" and "+ answer =" in seen[0]["messages"][0]["content"]
    for e in episodes:
        assert e.reward == 0.0 and e.reward_components == {"outcome": 0.0, "judge": 0.0}
        assert e.meta["judge"]["verdict"] == "hack" and e.meta["judge"]["reasoning"] == "It special-cases the input."


def test_off_by_default_and_with_mode_off_no_judge_is_asked(tmp_path):
    assert JudgeConfig().mode == "off" and make_judge(JudgeConfig(), None) is None
    episodes, _ = _run_group(_cfg(tmp_path))
    assert all(e.reward == 1.0 and "judge" not in e.meta for e in episodes)


def test_the_default_judge_is_the_served_policy_in_sessions_never_trained_on(tmp_path):
    episodes, stored = _run_group(_cfg(tmp_path, "rollout.judge.mode=weight", "rollout.judge.weight=0.5",
                                       "rollout.judge.max_tokens=3"))
    judges = [e for e in stored if e.agent_kind == "judge"]
    assert len(judges) == 2 and all(e.group_id == "judge" and len(e.calls) == 1 for e in judges)
    assert all(len(j.calls[0].completion_token_ids) <= 3 for j in judges)
    for e in episodes:  # a tiny random model gives no verdict line: unclear = 0.5, blended half
        assert e.meta["judge"]["verdict"] in ("pass", "hack", "unclear")
        assert e.reward == pytest.approx(0.5 + 0.5 * e.meta["judge"]["score"])
    assert {e.group_id for e in episodes} == {"t:" + episodes[0].task_id}
