"""rollout.agent=command: a black-box program (the official openai client, examples/blackbox_agent.py)
runs once per episode of a real `arborl train`, reaching the run's gateway over HTTP; its calls are
recorded and trained on like a white-box agent's."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from arborl.agents.served import serve_http
from arborl.run.assemble import build_gateway
from arborl.config import ConfigError, load_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.registry import load_object
from arborl.types import EpisodeStatus

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=256", "scheduling.timeline=false"]


def _cfg(tmp_path, name, command, *extra):
    return load_config(REPO / "configs/blackbox.yaml", [
        f"name={name}", f"runs_dir={tmp_path}", *TINY, "rollout.steps=1", "rollout.batch_tasks=2",
        "rollout.group_size=2", "rollout.max_tokens=5", "rollout.eval_tasks=0", "train.lr=0.05",
        f"rollout.agent_command={json.dumps(command)}", *extra])


def _episodes(cfg):
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        return [pool.get_episode(e.episode_id) for e in pool.episodes()]


def _steps(cfg):
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "step"]


def test_a_black_box_program_is_the_agent_of_a_training_run(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = _cfg(tmp_path, "bb", [sys.executable, "examples/blackbox_agent.py"])
    train(cfg)
    episodes = _episodes(cfg)
    reward = load_object("examples/capitals/reward.py:reward")
    rows = [json.loads(x) for x in (REPO / "examples/capitals/train.jsonl").read_text().splitlines()]
    assert len(episodes) == 4
    for e in episodes:
        assert e.status == EpisodeStatus.FINISHED, e.meta
        bb = e.meta["blackbox"]
        assert bb["returncode"] == 0 and bb["timed_out"] is False
        assert f"task {e.task_id}:" in bb["stderr_tail"]  # the program saw its task (ARBORL_TASK)
        (call,) = e.calls  # recorded through the HTTP gateway
        assert 1 <= len(call.completion_token_ids) <= 5  # max_tokens reached it through ARBORL_SAMPLING
        answer = e.meta["outcome"]["answer"] or ""  # its stdout
        row = rows[int(e.task_id.split("-")[2])]
        assert e.reward_components == reward(None, answer, e.calls, row["answer"])
    (step,) = _steps(cfg)
    assert step["episodes"] == 4 and step["unusable_episodes"] == 0


def test_a_failing_program_fails_its_episodes_and_nothing_is_trained(tmp_path):
    cfg = _cfg(tmp_path, "bb-fail", [sys.executable, "-c", "import sys; print('no'); sys.exit(3)"],
               f"rollout.data.train_files=[{REPO}/examples/capitals/train.jsonl]",
               f"rollout.data.reward_function={REPO}/examples/capitals/reward.py:reward")
    train(cfg)
    episodes = _episodes(cfg)
    assert len(episodes) == 4
    assert all(e.status == EpisodeStatus.FAILED and e.meta["blackbox"]["returncode"] == 3 for e in episodes)
    (step,) = _steps(cfg)
    assert step["samples"] == 0 and step["unusable_episodes"] == 4


def test_command_needs_its_argv():
    with pytest.raises(ConfigError, match=r"rollout: .*agent=command needs agent_command"):
        load_config(None, ["rollout.agent=command"])
    assert load_config(None, ["rollout.agent=command", "rollout.agent_command=[prog]"]).rollout.agent_command == ["prog"]


def test_serve_http_is_shared_on_the_loop_and_stops_with_its_last_user(tmp_path):
    cfg = load_config(None, [f"runs_dir={tmp_path}", *TINY])
    built = build_gateway(cfg)

    async def main():
        async with serve_http(built.gateway) as url:
            async with serve_http(built.gateway) as again:
                assert again == url
            async with httpx.AsyncClient() as http:  # still served: one user left
                r = await http.get(url + "/models", headers={"Authorization": f"Bearer {built.gateway.admin_key}"})
                assert r.status_code == 200 and r.json()["data"][0]["id"] == built.gateway.model_name
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # then it stops
            await asyncio.sleep(0.05)
            try:
                async with httpx.AsyncClient() as http:
                    await http.get(url + "/models")
            except httpx.ConnectError:
                return url
        raise AssertionError("the server still answers after its last user left")

    try:
        url = asyncio.run(main())
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    finally:
        built.close()


def test_a_program_past_the_agent_timeout_is_killed_and_its_episode_aborted(tmp_path):
    import os
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    prog = f"import os, time; open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close(); time.sleep(60)"
    cfg = _cfg(tmp_path, "bb-slow", [sys.executable, "-c", prog], "rollout.agent_timeout_s=1.5",
               f"rollout.data.train_files=[{REPO}/examples/capitals/train.jsonl]",
               f"rollout.data.reward_function={REPO}/examples/capitals/reward.py:reward")
    t0 = time.monotonic()
    train(cfg)
    assert time.monotonic() - t0 < 30
    episodes = _episodes(cfg)
    assert len(episodes) == 4 and all(e.status == EpisodeStatus.ABORTED for e in episodes)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 4
    for pid in started:  # every program was killed
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
