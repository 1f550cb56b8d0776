"""Extension points by config: a user's own loss (with its own settings) and task suite, each one file
outside the package and one config line, run in a real `arborl train`; bad names and bad loss settings
fail before the model loads."""

from __future__ import annotations

import json
import textwrap

import pytest

from arborl.config import ConfigError, load_config
from arborl.datapool import DataPool
from arborl.run.job import train
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
from pydantic import BaseModel, Field

from arborl.train.policy_losses import ppo_clip_token_loss, with_settings

SEEN = []


class Settings(BaseModel):
    scale: float = Field(1.0, ge=0, description="the PPO token loss is multiplied by this")
    clip: float = Field(0.2, gt=0, lt=1, description="ratio clip on both sides")


@with_settings(Settings)
def scaled_ppo(logp, old_logp, advantages, *, scale, clip):
    """PPO's token loss times ``scale`` (0: the policy must not move)."""
    SEEN.append((scale, clip))
    loss, clipped = ppo_clip_token_loss(logp, old_logp, advantages, clip_low=clip, clip_high=clip)
    return loss * scale, clipped
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


def test_a_user_task_and_a_user_loss_with_its_own_settings_from_files_run_in_training(tmp_path):
    (tmp_path / "my_task.py").write_text(textwrap.dedent(TASK_FILE))
    (tmp_path / "my_loss.py").write_text(textwrap.dedent(LOSS_FILE))
    cfg = _cfg(tmp_path, "mine", f"rollout.task={tmp_path}/my_task.py:make_suite",
               f"train.loss.kind={tmp_path}/my_loss.py:scaled_ppo", "train.loss.settings.scale=0.0",
               "train.loss.settings.clip=0.15", "train.advantage.drop_zero_variance=false")
    train(cfg)
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(e.episode_id) for e in pool.episodes()]
    assert len(episodes) == 8 and all(e.task_id.startswith("countdown-train-") for e in episodes)
    for e in episodes:  # the user's score is what the data pool holds
        toks = [t for c in e.calls for t in c.completion_token_ids]
        assert e.reward == pytest.approx(sum(t % 2 == 0 for t in toks) / len(toks))
    (step,) = _steps(cfg)
    seen = load_object(f"{tmp_path}/my_loss.py:SEEN")
    assert load_object(f"{tmp_path}/my_loss.py:scaled_ppo").__module__.startswith("arborl_user_")
    assert seen and set(seen) == {(0.0, 0.15)}  # the settings reached the loss, validated (floats)
    assert step["train/grad_norm"] == 0.0  # the user's loss, at its setting scale=0, made the gradient
    seen.clear()

    base = _cfg(tmp_path, "scale1", f"rollout.task={tmp_path}/my_task.py:make_suite",
                f"train.loss.kind={tmp_path}/my_loss.py:scaled_ppo", "train.advantage.drop_zero_variance=false")
    train(base)
    assert set(seen) == {(1.0, 0.2)}  # unset settings: the loss's defaults
    assert _steps(base)[0]["train/grad_norm"] > 0.0  # the same loss at its default scale moves the policy


@pytest.mark.parametrize("kind,settings,message", [
    ("my_loss.py:scaled_ppo", ["train.loss.settings.scale=-1"],
     r"train.loss.settings.scale: Input should be greater than or equal to 0 \(got -1\)"),
    ("my_loss.py:scaled_ppo", ["train.loss.settings.clip_low=0.1"],
     "train.loss.settings.clip_low: not a setting of train.loss.kind=.*scaled_ppo; its settings are scale, clip"),
    ("cispo", ["train.loss.settings.clip_low=0.1"],
     "train.loss.settings.clip_low: not a setting of train.loss.kind=cispo; its settings are eps_high, eps_low"),
    ("ppo", ["train.loss.settings.dual_clip=0.5"], "train.loss.settings.dual_clip: Input should be greater than 1"),
    ("sft", ["train.loss.settings.clip_high=0.3"],
     "train.loss.settings.clip_high: not a setting of train.loss.kind=sft; it has none"),
])
def test_a_bad_setting_for_the_chosen_loss_fails_before_the_model_loads_naming_it(tmp_path, kind, settings, message):
    (tmp_path / "my_loss.py").write_text(textwrap.dedent(LOSS_FILE))
    kind = f"{tmp_path}/{kind}" if kind.endswith("scaled_ppo") else kind
    cfg = _cfg(tmp_path, "bad", f"train.loss.kind={kind}", *settings, "model.source=hf", "model.path=/nonexistent")
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not (cfg.run_dir / "config.yaml").exists()


def test_an_old_flat_loss_key_names_its_new_place(tmp_path):
    with pytest.raises(ConfigError, match=r"train.loss: cispo_eps_high moved: set train.loss.settings.eps_high \(a "
                       "setting of train.loss.kind cispo"):
        _cfg(tmp_path, "old", "train.loss.kind=cispo", "train.loss.cispo_eps_high=0.2")
    with pytest.raises(ConfigError, match="train.loss: clip_low moved: set train.loss.settings.clip_low"):
        _cfg(tmp_path, "old", "train.loss.clip_low=0.1")


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
