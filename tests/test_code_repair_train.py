"""`arborl train` on the code_repair suite: the built-in white-box code agent, and a black-box CLI agent
(examples/code_repair_agent.py, the official openai SDK) run inside each episode's sandbox from a
rollout worker process; every model call is recorded through the gateway and the trainer trains on
exactly the recorded tokens; the hidden tests' per-test results and the agent's change are kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from arborl.config import load_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.train.samples import build_samples
from arborl.types import EpisodeStatus

REPO = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        f"name={name}", f"runs_dir={tmp_path}", "model.source=tiny", "model.tiny_tokenizer=smollm2",
        "model.tiny_layers=1", "model.tiny_hidden=32", "engine.max_seq_len=1024", "scheduling.timeline=false",
        "rollout.task=code_repair", f"rollout.code_repair.suite_dir={tmp_path / 'suite'}",
        "rollout.code_repair.per_template=1", "rollout.code_repair.require_validated=false",
        "rollout.code_repair.tier=easy", f"rollout.envs.root_dir={tmp_path / 'ws'}",
        "rollout.steps=1", "rollout.batch_tasks=1", "rollout.group_size=2", "rollout.max_tokens=8",
        "rollout.max_turns=2", "rollout.eval_tasks=0", "train.advantage.drop_zero_variance=false", *extra])


def _episodes(cfg):
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        return [pool.get_episode(e.episode_id) for e in pool.episodes()]


def _step(cfg):
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if r["kind"] == "step"]
    return step


def _check_trained_as_recorded(cfg, episodes):
    step = _step(cfg)
    assert step["episodes"] == 2 and step["samples"] >= 2 and step["unusable_episodes"] == 0
    samples, _ = build_samples(episodes, cfg.train.advantage)
    for s, e in zip(sorted(samples, key=lambda s: s.episode_id), sorted(episodes, key=lambda e: e.episode_id)):
        first = e.calls[0]
        assert s.token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
        generated = [t for t, m in zip(s.token_ids, s.loss_mask) if m]
        assert generated[: len(first.completion_token_ids)] == first.completion_token_ids


def test_the_white_box_code_agent_trains_on_code_repair(tmp_path):
    cfg = _cfg(tmp_path, "cr-white")
    train(cfg)
    episodes = _episodes(cfg)
    assert len(episodes) == 2
    for e in episodes:
        assert e.status == EpisodeStatus.FINISHED and 1 <= len(e.calls) <= 2
        info = e.meta["outcome"]["info"]["code_repair"]
        assert info["total"] == len(info["tests"]) >= 2 and set(info["tests"].values()) <= {"passed", "failed", "error", "missing"}
        assert e.reward_components["tests_passed_frac"] == info["passed"] / info["total"]
        assert isinstance(info["diff"], str)
    _check_trained_as_recorded(cfg, episodes)
    assert not list((tmp_path / "ws").glob("*ep*"))  # every workspace closed


def test_a_black_box_cli_agent_runs_in_the_sandbox_from_a_worker_and_is_trained(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the command and the bound examples/ are the working directory's
    cfg = _cfg(tmp_path, "cr-black", "rollout.agent=command",
               f"rollout.agent_command={json.dumps([sys.executable, 'examples/code_repair_agent.py'])}",
               "rollout.envs.ro_binds=[examples]", "rollout.workers=1")
    train(cfg)
    episodes = _episodes(cfg)
    assert len(episodes) == 2
    for e in episodes:
        assert e.status in (EpisodeStatus.FINISHED, EpisodeStatus.FAILED), e.meta
        assert not e.meta.get("infra_error") and len(e.calls) >= 1
        assert "code_repair" in e.meta["outcome"]["info"]  # the hidden tests ran after the program
        assert e.meta["outcome"]["info"]["returncode"] is not None
    _check_trained_as_recorded(cfg, episodes)
