"""The verifiers task suite: the real verifiers 0.4 (in .venv-vf: `make verifiers`, which `make test` runs)
running the example environment (examples/verifiers_guess: a Taskset, an Env whose run() answers each guess,
two rewards), its every model turn served by the run's gateway and trained through `arborl train` (tiny
model); its rewards are the episode's reward components; bad setups fail at start with what to fix."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from arborl.config import load_config
from arborl.datapool import DataPool
from arborl.models import load_model
from arborl.run.job import train
from arborl.tasks import make_suite
from arborl.tasks.verifiers_env import VerifiersEnvError

REPO = Path(__file__).resolve().parents[1]
VF_PYTHON = REPO / ".venv-vf/bin/python"
if not VF_PYTHON.exists():
    pytest.skip("verifiers is not installed in .venv-vf: run `make verifiers` (make test does)", allow_module_level=True)

TINY = ["model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=512", "scheduling.timeline=false"]


def _cfg(tmp_path, *extra):
    return load_config(REPO / "configs/verifiers.yaml", [f"runs_dir={tmp_path}", *TINY, *extra])


def test_a_verifiers_environment_trains_through_the_gateway(tmp_path):
    cfg = _cfg(tmp_path, "rollout.steps=1", "rollout.batch_tasks=2", "rollout.group_size=2", "rollout.eval_tasks=2",
               "rollout.max_tokens=6", "rollout.max_turns=3", "train.lr=0.05")
    suite = make_suite(cfg.rollout)
    assert len(suite.rows["train"]) + len(suite.rows["eval"]) == 400 and 40 < len(suite.rows["eval"]) < 120
    assert not {t.metadata["key"] for t in suite.rows["train"]} & {t.metadata["key"] for t in suite.rows["eval"]}
    summary = train(cfg)
    assert summary["steps"] == 1
    tok = load_model(cfg.model).tokenizer
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(e.episode_id) for e in pool.episodes()]
    assert len(episodes) == 2 * 2 + 2 * 2  # 4 trained, 2 held-out tasks evaluated twice
    multi = 0
    for e in episodes:
        assert e.status.value == "finished", e.meta.get("outcome")
        result = e.meta["outcome"]["info"]["verifiers"]
        assert result["ok"] and not result["errors"]
        assert json.loads(e.meta["outcome"]["answer"]) == {"reward": result["reward"], "rewards": result["rewards"]}
        found, valid = e.reward_components["found"], e.reward_components["valid"]
        assert e.reward_components["outcome"] == pytest.approx(found + 0.1 * valid)  # verifiers' weighted reward
        assert len(e.calls) == result["turns"] and 1 <= len(e.calls) <= 3  # every turn reached the gateway
        first = tok.decode(e.calls[0].prompt_token_ids)
        assert "Guess my secret number from 1 to 16" in first
        if len(e.calls) > 1:  # the Env's answer to the first reply is the next prompt's new user turn
            multi += 1
            later = tok.decode(e.calls[1].prompt_token_ids)
            assert re.search(r"is wrong: my number is (higher|lower)|Reply with just a number", later)
            assert later.startswith(first[: len(first) - 30])
    assert multi, "a random tiny model never guesses right at once: some episode went on"
    metrics = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("kind") == "eval" for m in metrics)
    assert not _bridges(), "the job closed its verifiers bridge process"


def _bridges() -> list[str]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if p.name.isdigit() and "verifiers_bridge.py serve" in cmd:
            out.append(cmd)
    return out


def test_setup_mistakes_fail_at_start_saying_what_to_fix(tmp_path):
    with pytest.raises(VerifiersEnvError, match="not installed in that interpreter: run `make verifiers`"):
        make_suite(_cfg(tmp_path, f"rollout.verifiers.python={sys.executable}").rollout)
    with pytest.raises(VerifiersEnvError, match="needs rollout.verifiers.env"):
        make_suite(_cfg(tmp_path, "rollout.verifiers.env=").rollout)
    with pytest.raises(VerifiersEnvError, match="does not exist"):
        make_suite(_cfg(tmp_path, f"rollout.verifiers.env={tmp_path}/nope.py").rollout)
    with pytest.raises(VerifiersEnvError, match="no_such_env"):
        make_suite(_cfg(tmp_path, "rollout.verifiers.env=no_such_env").rollout)
