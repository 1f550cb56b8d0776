"""The gym task suite: real Gymnasium and SkyRL-Gym environments trained end to end through `arborl
train` (tiny model, white-box loop, real gateway and data pool); per-turn rewards land as process
rewards on their own call, the last as the outcome; text-only, with typed errors for everything else."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from arborl.config import ConfigError
from arborl.datapool import DataPool
from arborl.models import load_model
from arborl.run.job import train
from arborl.tasks import make_suite
from arborl.tasks.gym_env import EnvEpisode, GymEnvError, as_messages

from helpers.tiny_run import tiny_cfg

REPO = Path(__file__).resolve().parents[1]

ENVS = '''
import gymnasium as gym
import numpy as np
from gymnasium import spaces
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

BUILT = []


class Counting(gym.Env):
    """Turn k (from 1) earns k / 10; the episode terminates after `length` steps."""

    def __init__(self, length=3):
        self.length = length
        self.observation_space = spaces.Text(200)
        self.action_space = spaces.Text(2000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.k = 0
        self.seed_seen = seed
        return f"start {seed}", {}

    def step(self, action):
        self.k += 1
        return f"turn {self.k} after {len(action)} chars", self.k / 10, self.k >= self.length, False, {"k": self.k}


class Pixels(Counting):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros((2, 2)), {}


class Echo(BaseTextEnv):
    """SkyRL-Gym style: the reward is 1 when the reply contains the row's target, after 2 turns."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.target = extras["reward_spec"]["ground_truth"]
        self.bonus = env_config.bonus
        BUILT.append(dict(extras))
        self.turns = 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.turns += 1
        done = self.turns >= 2
        reward = (1.0 if self.target in action else 0.0) + self.bonus
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": "again"}] if not done else [],
                                     reward=reward, done=done, metadata={})


def broken(**kw):
    raise RuntimeError("no license for this env")
'''


@pytest.fixture
def envs_file(tmp_path) -> Path:
    path = tmp_path / "my_envs.py"
    path.write_text(textwrap.dedent(ENVS))
    return path


def _episodes(cfg) -> list:
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        return [pool.get_episode(e.episode_id) for e in pool.episodes()]


def test_a_gymnasium_env_trains_and_its_per_turn_rewards_land_on_their_calls(tmp_path, envs_file):
    cfg = tiny_cfg(tmp_path, "gym", "rollout.task=gym", f"rollout.gym.env={envs_file}:Counting",
                   "rollout.gym.env_kwargs={length: 3}", "rollout.max_turns=4", "rollout.steps=2",
                   "rollout.batch_tasks=2", "rollout.group_size=2", "rollout.eval_tasks=2", "rollout.gym.eval_seed=500")
    summary = train(cfg)
    assert summary["steps"] == 2
    episodes = _episodes(cfg)
    tok = load_model(cfg.model).tokenizer
    trained = [e for e in episodes if e.group_id.startswith("step")]
    evaluated = [e for e in episodes if e.group_id.startswith("eval")]
    assert len(trained) == 2 * 2 * 2
    assert sorted({e.task_id for e in evaluated}) == ["gym-eval-500", "gym-eval-501"]  # fixed held-out seeds
    assert all(int(e.task_id.rsplit("-", 1)[1]) < 500 for e in trained)  # training seeds below them
    for e in trained:
        assert e.status.value == "finished", e.meta
        assert len(e.calls) == 3  # terminated after the third step, before max_turns
        steps = [i for i in e.interactions if i.get("kind") == "env_step"]
        assert [s["reward"] for s in steps] == [0.1, 0.2, 0.3]
        assert [s["call_id"] for s in steps] == [c.call_id for c in e.calls]
        # the first two turns' rewards are process rewards on their own calls; the last is the outcome
        process = [(r["call_id"], r["value"]) for r in e.meta["rewards"]]
        assert process == [(e.calls[0].call_id, 0.1), (e.calls[1].call_id, 0.2)]
        assert e.reward_components["outcome"] == pytest.approx(0.3)
        assert e.reward_components["return"] == pytest.approx(0.6)
        assert e.reward_components["terminated"] == 1.0
        # the reset observation is the first prompt; the one after turn 1 ends the second prompt
        seed = e.task_id.rsplit("-", 1)[1]
        assert f"start {seed}" in tok.decode(e.calls[0].prompt_token_ids)
        first = tok.decode(e.calls[0].prompt_token_ids + e.calls[0].completion_token_ids)
        assert "turn 1 after" in tok.decode(e.calls[1].prompt_token_ids)[len(first):]
    metrics = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m for m in metrics if m.get("kind") == "eval"], "held-out evaluation ran"
    peaks = [m["memory/peak_rss_gb"] for m in metrics if m.get("kind") == "step"]
    assert 0.2 < peaks[0] <= peaks[1]  # the job's peak so far: torch alone holds more; it never goes down


def test_max_turns_ends_an_episode_and_its_last_reward_is_the_outcome(tmp_path, envs_file):
    cfg = tiny_cfg(tmp_path, "gym-cut", "rollout.task=gym", f"rollout.gym.env={envs_file}:Counting",
                   "rollout.gym.env_kwargs={length: 9}", "rollout.max_turns=2", "rollout.steps=1",
                   "rollout.batch_tasks=1", "rollout.group_size=2", "rollout.gym.system_prompt=Play well.")
    train(cfg)
    tok = load_model(cfg.model).tokenizer
    for e in _episodes(cfg):
        assert tok.decode(e.calls[0].prompt_token_ids).count("Play well.") == 1  # the system message
        assert len(e.calls) == 2
        assert [r["value"] for r in e.meta["rewards"]] == [0.1]
        assert e.reward_components == {"outcome": pytest.approx(0.2), "return": pytest.approx(0.3), "terminated": 0.0}


def test_a_skyrl_gym_env_reads_its_rows_prompt_and_extras(tmp_path, envs_file):
    rows = [{"prompt": [{"role": "user", "content": f"Say {w}."}], "reward_spec": {"ground_truth": w}, "tag": i}
            for i, w in enumerate(["alpha", "beta", "gamma"])]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    cfg = tiny_cfg(tmp_path, "skyrl", "rollout.task=gym", f"rollout.gym.env={envs_file}:Echo",
                   "rollout.gym.env_kwargs={bonus: 0.5}", f"rollout.data.train_files=[{tmp_path}/train.jsonl]",
                   f"rollout.data.eval_files=[{tmp_path}/eval.jsonl]", "rollout.max_turns=3", "rollout.steps=1",
                   "rollout.batch_tasks=3", "rollout.group_size=2", "rollout.eval_tasks=1")
    train(cfg)
    episodes = _episodes(cfg)
    tok = load_model(cfg.model).tokenizer
    trained = [e for e in episodes if e.group_id.startswith("step")]
    assert sorted(e.task_id for e in trained) == sorted(f"data-train-{i}" for i in range(3) for _ in range(2))
    for e in trained:
        row = rows[int(e.task_id.rsplit("-", 1)[1])]
        assert len(e.calls) == 2  # done after the second step
        assert row["prompt"][0]["content"] in tok.decode(e.calls[0].prompt_token_ids)
        assert "again" in tok.decode(e.calls[1].prompt_token_ids)[len(tok.decode(e.calls[0].prompt_token_ids)):]
        assert e.reward_components["outcome"] >= 0.5 and e.meta["rewards"][0]["value"] >= 0.5  # env_config.bonus
    from arborl.registry import load_object
    built = load_object(f"{envs_file}:BUILT")
    assert {"reward_spec": {"ground_truth": "beta"}, "tag": 1} in built  # the row's other columns are the extras


def test_bad_environments_fail_before_training_with_the_reason(tmp_path, envs_file):
    def suite(*extra):
        return make_suite(tiny_cfg(tmp_path, "x", "rollout.task=gym", *extra).rollout)

    with pytest.raises(GymEnvError, match="needs rollout.gym.env"):
        suite()
    with pytest.raises(GymEnvError, match="not text"):
        suite(f"rollout.gym.env={envs_file}:Pixels")
    with pytest.raises(GymEnvError, match="no license"):
        suite(f"rollout.gym.env={envs_file}:broken")
    with pytest.raises(GymEnvError, match="rollout.data.train_files"):
        suite(f"rollout.gym.env={envs_file}:Echo")
    with pytest.raises(GymEnvError, match="has no attribute"):
        suite(f"rollout.gym.env={envs_file}:Missing")
    assert issubclass(GymEnvError, ConfigError)


def test_a_step_that_breaks_the_convention_is_named():
    class FourTuple:
        def reset(self, seed=None):
            return "hi", {}

        def step(self, action):
            return "obs", 1.0, True, {}  # Gymnasium < 0.26's 4-tuple

    episode = EnvEpisode(FourTuple())
    with pytest.raises(GymEnvError, match="5-tuple"):
        episode.step("x")
    with pytest.raises(GymEnvError, match="neither reset"):
        EnvEpisode(type("Only", (), {"step": lambda self, a: None})())
    assert as_messages({"role": "tool", "content": "r"}, "x") == [{"role": "tool", "content": "r"}]
    with pytest.raises(GymEnvError, match="not text"):
        as_messages(7, "obs")


def test_the_shipped_gym_config_builds_its_environment():
    from arborl.config import load_config

    cfg = load_config(REPO / "configs/gym.yaml", ["model.source=tiny"])
    suite = make_suite(cfg.rollout)
    tasks = suite.tasks("eval", 3)
    assert [t.metadata["seed"] for t in tasks] == [cfg.rollout.gym.eval_seed + i for i in range(3)]
    env = suite.make_env(tasks[0])
    episode = EnvEpisode(env)
    (first,) = episode.start(tasks[0])
    assert "from 1 to 16" in first["content"]
    secret = env.secret
    wrong = episode.step(str(secret - 1 if secret > 1 else secret + 1))
    assert (wrong.reward, wrong.done) == (0.1, False)  # a valid guess earns the format reward
    assert "higher" in wrong.messages[0]["content"] or "lower" in wrong.messages[0]["content"]
    assert episode.step("no idea").reward == 0.0
    right = episode.step(f"It is {secret}")
    assert (right.reward, right.terminated) == (1.0, True)
