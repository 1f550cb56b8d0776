"""Extension points by config: a user's own loss and task suite, each one file outside the package and
one config line, run in a real `arborl train`; bad names fail before the model loads."""

from __future__ import annotations

import json
import textwrap

import pytest

from arborl.config import ConfigError, load_config
from arborl.datapool import DataPool
from arborl.job import train
from arborl.registry import Registry, RegistryError, load_object

TASK_FILE = '''
from arborl.agents import ReActAgent
from arborl.types import Task


class CountdownSuite:
    """Reward: fraction of generated token ids that are even (varies within a group whatever the seed)."""

    name = "countdown"

    def tasks(self, split, n, seed=0):
        return [Task(task_id=f"countdown-{split}-{seed}-{i}", prompt=f"Count down from {i + 3}.", split=split)
                for i in range(n)]

    def agent(self, sampling):
        return ReActAgent([], max_turns=1, **sampling)

    def score(self, task, outcome, calls):
        toks = [t for c in calls for t in c.completion_token_ids]
        return {"outcome": sum(t % 2 == 0 for t in toks) / len(toks) if toks else 0.0}


def make_suite(rollout):
    return CountdownSuite()
'''

LOSS_FILE = '''
from arborl.train.losses import ppo_clip_token_loss

SEEN = []


def frozen_ppo(logp, old_logp, advantages, **options):
    """PPO's token loss times zero: the policy must not move."""
    SEEN.append(options["clip_low"])
    loss, clipped = ppo_clip_token_loss(logp, old_logp, advantages, clip_low=0.2, clip_high=0.2)
    return loss * 0.0, clipped
'''


def _cfg(tmp_path, name, *extra):
    return load_config(None, [
        f"name={name}", f"runs_dir={tmp_path}", "seed=1",
        "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=256", "rollout.batch_tasks=2", "rollout.group_size=4", "rollout.max_tokens=6",
        "rollout.eval_tasks=0", "rollout.steps=1", "train.lr=0.05", "scheduling.timeline=false", *extra,
    ])


def _steps(cfg):
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "step"]


def test_a_user_task_and_a_user_loss_from_files_run_in_training(tmp_path):
    (tmp_path / "my_task.py").write_text(textwrap.dedent(TASK_FILE))
    (tmp_path / "my_loss.py").write_text(textwrap.dedent(LOSS_FILE))
    cfg = _cfg(tmp_path, "mine", f"rollout.task={tmp_path}/my_task.py:make_suite",
               f"train.loss.kind={tmp_path}/my_loss.py:frozen_ppo", "train.loss.clip_low=0.15",
               "train.advantage.drop_zero_variance=false")
    train(cfg)
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(e.episode_id) for e in pool.episodes()]
    assert len(episodes) == 8 and all(e.task_id.startswith("countdown-train-") for e in episodes)
    for e in episodes:  # the user's score is what the data pool holds
        toks = [t for c in e.calls for t in c.completion_token_ids]
        assert e.reward == pytest.approx(sum(t % 2 == 0 for t in toks) / len(toks))
    (step,) = _steps(cfg)
    assert load_object(f"{tmp_path}/my_loss.py:frozen_ppo").__module__.startswith("arborl_user_")
    assert load_object(f"{tmp_path}/my_loss.py:SEEN") and set(load_object(f"{tmp_path}/my_loss.py:SEEN")) == {0.15}
    assert step["train/grad_norm"] == 0.0  # the user's loss, not ppo, made the gradient

    base = _cfg(tmp_path, "ppo", f"rollout.task={tmp_path}/my_task.py:make_suite",
                "train.advantage.drop_zero_variance=false")
    train(base)
    assert _steps(base)[0]["train/grad_norm"] > 0.0  # the same job under the built-in loss moves


@pytest.mark.parametrize("key,value,kind", [
    ("train.loss.kind", "ppoo", "policy loss"), ("rollout.task", "calculater", "task suite"),
    ("scheduling.consume", "fifo", "consumption policy"), ("scheduling.dispatch", "random", "dispatch policy"),
    ("train.advantage.estimator", "gae", "advantage estimator"), ("rollout.agent", "nope", "agent"),
])
def test_an_unknown_name_fails_before_the_model_loads_naming_the_key(tmp_path, key, value, kind):
    cfg = _cfg(tmp_path, "bad", f"{key}={value}", "model.source=hf", "model.path=/nonexistent")
    with pytest.raises(ConfigError, match=f"{key}: unknown {kind} '{value}': choose one of"):
        train(cfg)
    assert not (cfg.run_dir / "config.yaml").exists()


def test_registry_paths_and_errors(tmp_path):
    reg: Registry = Registry("thing")

    @reg.register("one")
    def one():
        return 1

    assert reg.get("one") is one and reg.names() == ["one"]
    assert reg.get("json:dumps")([1]) == "[1]"  # an importable module:attr
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("one")(lambda: 2)
    with pytest.raises(RegistryError, match="does not exist"):
        reg.get(f"{tmp_path}/missing.py:f")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RegistryError, match="importing .* failed: RuntimeError"):
        reg.get(f"{tmp_path}/broken.py:f")
    (tmp_path / "ok.py").write_text("x = 1\n")
    with pytest.raises(RegistryError, match="has no attribute 'y'"):
        reg.get(f"{tmp_path}/ok.py:y")
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module_xyz'"):
        reg.get("no_such_module_xyz:f")
