"""Rollout workers (rollout.workers > 0, A4): episodes run in worker processes that reach the gateway
over HTTP; a worker killed mid-episode loses no other episode and its own are retried as
infrastructure failures (recorded, never trained on); an agent's own crash is an ordinary failed
episode; a worker whose event loop stalls is killed and replaced."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from arborl.run.assemble import build_gateway
from arborl.config import load_config
from arborl.run.controller import Controller
from arborl.tasks import make_suite
from arborl.types import EpisodeStatus

HELPERS = Path(__file__).resolve().parent / "helpers" / "worker_agents.py"
REPO = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, agent, *extra):
    return load_config(None, [
        "name=w", f"runs_dir={tmp_path}", "model.source=tiny", "model.tiny_tokenizer=smollm2",
        "model.tiny_layers=1", "model.tiny_hidden=32", "engine.max_seq_len=256", "scheduling.timeline=false",
        "rollout.task=even_tokens", "rollout.batch_tasks=1", "rollout.group_size=4", "rollout.eval_tasks=0",
        f"rollout.agent={HELPERS}:{agent}", "rollout.workers=2", *extra])


async def _run(cfg, body):
    built = build_gateway(cfg)
    ctl = Controller(cfg, built.gateway, built.engines, built.pool, None, make_suite(cfg.rollout))
    try:
        return await body(ctl), ctl, built.pool.episodes()
    finally:
        await ctl.close()
        built.close()


def test_episodes_run_in_worker_processes_over_http(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORL_TEST_MARKS", str(tmp_path))
    cfg = _cfg(tmp_path, "slow")

    async def body(ctl):
        tasks = make_suite(cfg.rollout).tasks("train", 1)
        episodes = await ctl.run_groups(tasks, 4, temperature=1.0, tag="t")
        return episodes, ctl.workers.pids(), ctl.workers.stats()

    (episodes, pids, stats), ctl, _ = asyncio.run(_run(cfg, body))
    assert ctl.workers is None  # closed with the controller
    assert stats["workers"] == 2 and stats["worker_deaths"] == 0
    assert all(e.status == EpisodeStatus.FINISHED and len(e.calls) == 1 for e in episodes)
    ran_in = {int(e.meta["outcome"]["answer"]) for e in episodes}
    assert ran_in <= set(pids) and os.getpid() not in ran_in
    assert all(e.interactions and e.interactions[0]["kind"] == "note" for e in episodes)  # POST .../interaction
    for pid in pids:  # no worker left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_killed_mid_episode_loses_no_other_episode_and_its_own_are_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORL_TEST_MARKS", str(tmp_path))
    monkeypatch.setenv("ARBORL_TEST_HOLD", "1")
    cfg = _cfg(tmp_path, "slow")

    async def body(ctl):
        tasks = make_suite(cfg.rollout).tasks("train", 1)
        run = asyncio.create_task(ctl.run_groups(tasks, 4, temperature=1.0, tag="t"))
        while len(list(tmp_path.glob("*-*"))) < 4:  # every episode has made its call and is sleeping
            await asyncio.sleep(0.05)
        victim = int(next(tmp_path.glob("*-*")).name.split("-")[0])
        held = len(list(tmp_path.glob(f"{victim}-*")))
        os.kill(victim, signal.SIGKILL)
        (tmp_path / "release").touch()  # the others (and the retries) may finish now
        return await run, victim, held, ctl.infra_failures, ctl.workers.stats()

    (episodes, victim, held, infra, stats), _, stored = asyncio.run(_run(cfg, body))
    assert len(episodes) == 4 and all(e.status == EpisodeStatus.FINISHED for e in episodes)
    assert victim not in {int(e.meta["outcome"]["answer"]) for e in episodes}
    assert infra == held >= 1 and stats["worker_deaths"] == 1
    failed = [e for e in stored if e.meta.get("infra_error")]
    assert len(failed) == held and len(stored) == 4 + held
    assert all(e.status == EpisodeStatus.FAILED and "died" in e.meta["infra_error"] for e in failed)
    assert {e.episode_id for e in episodes}.isdisjoint(e.episode_id for e in failed)


def test_an_agents_crash_in_a_worker_is_its_own_failed_episode_not_an_infrastructure_failure(tmp_path):
    cfg = _cfg(tmp_path, "crash")

    async def body(ctl):
        tasks = make_suite(cfg.rollout).tasks("train", 1)
        return await ctl.run_groups(tasks, 2, temperature=1.0, tag="t"), ctl.infra_failures

    (episodes, infra), _, _ = asyncio.run(_run(cfg, body))
    assert infra == 0
    for e in episodes:
        assert e.status == EpisodeStatus.FAILED and "the agent's own bug" in e.meta["outcome"]["info"]["error"]
        assert len(e.calls) == 1 and not e.meta.get("infra_error")


def test_a_worker_that_stalls_is_killed_and_its_episode_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORL_TEST_MARKS", str(tmp_path))
    cfg = _cfg(tmp_path, "block", "rollout.workers=1", "rollout.worker_stall_s=2")

    async def body(ctl):
        tasks = make_suite(cfg.rollout).tasks("train", 1)
        return await ctl.run_groups(tasks, 1, temperature=1.0, tag="t"), ctl.infra_failures, ctl.workers.stats()

    (episodes, infra, stats), _, _ = asyncio.run(_run(cfg, body))
    assert episodes[0].status == EpisodeStatus.FINISHED and infra == 1 and stats["worker_restarts"] == 1


def test_without_retries_an_infrastructure_failure_stays_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBORL_TEST_MARKS", str(tmp_path))
    cfg = _cfg(tmp_path, "block", "rollout.workers=1", "rollout.worker_stall_s=2", "rollout.infra_retries=0")

    async def body(ctl):
        tasks = make_suite(cfg.rollout).tasks("train", 1)
        return await ctl.run_groups(tasks, 1, temperature=1.0, tag="t"), ctl.infra_failures

    ((episode,), infra), _, stored = asyncio.run(_run(cfg, body))
    assert infra == 1 and len(stored) == 1
    assert episode.status == EpisodeStatus.FAILED and "died" in episode.meta["infra_error"]


_WORKER_INIT = """
import json, sys
import arborl.workers.main
from arborl.agents import AGENTS
from arborl.agents.http_client import HttpSessionClient
from arborl.config import load_config
import arborl.envs.bwrap, arborl.envs.local
from arborl.tasks import make_suite
cfg = load_config(sys.argv[1], sys.argv[2:])
suite = make_suite(cfg.rollout)
AGENTS.get(cfg.rollout.agent)(suite, {"temperature": 1.0, "max_tokens": 8})
print(json.dumps(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)))
"""


def test_a_code_repair_worker_loads_without_torch(tmp_path):
    """A rollout worker only speaks HTTP to the gateway: what it loads for the code-repair job (its suite,
    the suite's agent, the sandbox runtime, the HTTP client) must not pull in torch, which costs each worker
    ~200 MB of resident memory (issue 46)."""
    out = subprocess.run(
        [sys.executable, "-c", _WORKER_INIT, str(REPO / "configs" / "code_repair.yaml"),
         f"rollout.code_repair.suite_dir={tmp_path / 'suite'}", "rollout.code_repair.require_validated=false",
         f"rollout.envs.root_dir={tmp_path / 'ws'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch" not in json.loads(out.stdout.splitlines()[-1])
