"""Demonstrations from the code_repair suite and rejection sampling (issue 31): a scripted expert reaches
each task's gold patch through the code agent's own tools in the sandbox, the hidden tests judge every
demo, a demo that fails them is dropped and counted; rejection sampling from an OpenAI-compatible
endpoint keeps exactly the episodes that pass."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from typer.testing import CliRunner

from arborl.cli import app
from arborl.config import load_config
from arborl.gateway.render import ChatRenderer
from arborl.gateway.transcript import transcript_sample
from arborl.models import load_model
from arborl.run.sft import episode_sft_samples, passing, sample_endpoint
from arborl.tasks.code_repair.demos import _script, expert_plan, make_demos
from arborl.tasks.code_repair.suite import CodeRepairSuite
from arborl.types import Call, Episode, EpisodeStatus


def _cfg(tmp_path, *extra):
    return load_config(None, [
        "name=demos", f"runs_dir={tmp_path}", "model.source=tiny", "model.tiny_tokenizer=smollm2",
        f"rollout.code_repair.suite_dir={tmp_path / 'suite'}", "rollout.code_repair.per_template=1",
        "rollout.code_repair.require_validated=false", "rollout.code_repair.tier=easy",
        f"rollout.envs.root_dir={tmp_path / 'ws'}", "rollout.max_turns=6", *extra])


def _suite(cfg):
    return CodeRepairSuite(cfg.rollout.code_repair, envs=cfg.rollout.envs, max_turns=cfg.rollout.max_turns)


def _tools(demo):
    return [c["function"]["name"] for m in demo["messages"] for c in m.get("tool_calls") or []]


def test_expert_demos_pass_the_hidden_tests_vary_their_path_and_a_failing_demo_is_dropped(tmp_path):
    cfg = _cfg(tmp_path)
    suite = _suite(cfg)
    tasks = suite.tasks("eval", 3) + [suite._task(t) for t in suite.pool("train")[:3]]
    sabotaged = tasks[0].task_id

    def planner(rt, rng, max_turns):  # the expert, except on one task where it edits nothing
        plan = expert_plan(rt, rng, max_turns)
        return [a for a in plan if a[0] != "replace_in_file"] if rt.id == sabotaged else plan

    report = asyncio.run(make_demos(suite, tasks, per_task=3, planner=planner))
    assert report.summary() == {"kept": 15, "dropped": 3, "tasks": 6}
    assert {d["task_id"] for d in report.dropped} == {sabotaged}
    assert all(d["passed"] < d["total"] for d in report.dropped)
    assert all(d["passed"] == d["total"] > 0 for d in report.demos)
    assert sabotaged not in {d["task_id"] for d in report.demos}
    # every kept demo edits through the agent's replace tool and ends with an answer (no tool call)
    assert all("replace_in_file" in _tools(d) and not d["messages"][-1].get("tool_calls") for d in report.demos)
    assert len({tuple(_tools(d)) for d in report.demos}) >= 3  # different paths, not one string
    tok = load_model(cfg.model).tokenizer
    s = transcript_sample(ChatRenderer(tok), report.demos[0]["messages"], report.demos[0]["tools"])
    assert sum(s.loss_mask) > 0
    assert not list((tmp_path / "ws").glob("*demo*"))  # every workspace closed


def test_arborl_envs_demos_writes_the_kept_transcripts(tmp_path):
    out = tmp_path / "d.jsonl"
    cfg = _cfg(tmp_path)
    args = ["envs", "demos", "code_repair", "--out", str(out), "--limit", "2", "--per-task", "1"]
    for o in ["name=demos", f"rollout.code_repair.suite_dir={tmp_path / 'suite'}", "rollout.code_repair.per_template=1",
              "rollout.code_repair.require_validated=false", "rollout.code_repair.tier=easy",
              f"rollout.envs.root_dir={tmp_path / 'ws'}", "rollout.max_turns=6"]:
        args += ["--set", o]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["kept"] == 2
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["split"] == "train" and r["messages"] and r["tools"] for r in rows)
    assert cfg.rollout.max_turns == 6


class _Endpoint:
    """An OpenAI-compatible chat endpoint on a loopback port that plays the scripted expert on the tasks it
    knows how to fix and answers at once (no fix) on the others."""

    def __init__(self, suite, fixable: set[str]) -> None:
        self.by_statement = {rt.statement: rt for rt in suite.all_tasks}
        self.fixable = fixable
        api = FastAPI()

        @api.post("/v1/chat/completions")
        async def chat(req: Request):
            body = await req.json()
            msgs = body["messages"]
            rt = self.by_statement[next(m["content"] for m in msgs if m["role"] == "user")]
            turn = sum(m["role"] == "assistant" for m in msgs)
            plan = expert_plan(rt, random.Random(rt.hash), 8) if rt.id in self.fixable else [("answer", {"content": "no idea"})]
            msg = _script(plan)(msgs, turn)
            return {"id": "x", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop"}]}

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(api, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def test_rejection_sampling_from_an_endpoint_keeps_exactly_the_passing_episodes(tmp_path):
    tasks_n = 4
    suite = _suite(_cfg(tmp_path))
    tasks = [suite._task(t) for t in suite.pool("train")[:tasks_n]]
    fixable = {tasks[0].task_id, tasks[2].task_id}
    with _Endpoint(suite, fixable) as ep:
        cfg = _cfg(tmp_path, f"train.sft.rejection.base_url={ep.url}", "train.sft.rejection.model=expert")
        tok = load_model(cfg.model).tokenizer
        kept, sampled = asyncio.run(sample_endpoint(suite, ChatRenderer(tok), tasks, 2, cfg))
    assert sampled == 8 and len(kept) == 4  # 2 fixable tasks x k=2, nothing of the others
    statements = {t.task_id: t.prompt for t in tasks}
    texts = [tok.decode(s.token_ids) for s in kept]
    assert sorted(sum(statements[t] in x for x in texts) for t in fixable) == [2, 2]
    assert all("replace_in_file" in x for x in texts)


def test_passing_keeps_finished_episodes_with_outcome_one_and_nothing_else():
    def ep(status, outcome, infra=False):
        e = Episode("t", "g", status=status, meta={"infra_error": "worker died"} if infra else {})
        e.calls = [Call(e.episode_id, [1, 2], [3, 4], [-0.1, -0.2], [-0.1, -0.2], [0, 0], "stop")]
        e.reward_components = {"outcome": outcome}
        return e

    eps = [ep(EpisodeStatus.FINISHED, 1.0), ep(EpisodeStatus.FINISHED, 0.0), ep(EpisodeStatus.FAILED, 1.0),
           ep(EpisodeStatus.ABORTED, 1.0), ep(EpisodeStatus.FINISHED, 1.0), ep(EpisodeStatus.FINISHED, 1.0, infra=True),
           ep(EpisodeStatus.FINISHED, 0.5)]
    assert passing(eps) == [eps[0], eps[4]]
    samples = episode_sft_samples(passing(eps))
    assert [s.token_ids for s in samples] == [[1, 2, 3, 4]] * 2 and samples[0].loss_mask == [0, 0, 1, 1]
