"""From scored episodes to trainer samples: GRPO per episode, reward-to-go per turn (C3/C4),
zero-variance groups dropped and counted, failed episodes never trained on."""

from __future__ import annotations

import pytest

from arborl.config import load_config
from arborl.rollout.sync import ScoredEpisode, SyncController
from arborl.types import Call, EpisodeStatus, Task


def episode(eid: str, group: str, reward: float, process=(), status=EpisodeStatus.FINISHED) -> ScoredEpisode:
    # two stitched turns: prompt [1,2] -> [3,4]; then [1,2,3,4,9] -> [5]
    c1 = Call(eid, [1, 2], [3, 4], [-0.1, -0.2], [-0.1, -0.2], [0, 0], "stop", call_id=f"{eid}-c1")
    c2 = Call(eid, [1, 2, 3, 4, 9], [5], [-0.3], [-0.3], [0], "stop", call_id=f"{eid}-c2")
    rewards = [{"name": "p", "value": v, "call_id": cid, "after_call": None} for cid, v in process]
    return ScoredEpisode(Task(eid, "q"), group, eid, status, None, [c1, c2], {"outcome": reward}, reward, 0.0, rewards)


def controller(*overrides: str) -> SyncController:
    return SyncController(load_config(None, list(overrides)), None, [], None, None, None)


def test_grpo_advantage_on_every_generated_token_and_zero_variance_dropped():
    eps = [episode("a", "g1", 1.0), episode("b", "g1", 0.0), episode("c", "g2", 1.0), episode("d", "g2", 1.0),
           episode("e", "g1", 0.0, status=EpisodeStatus.FAILED)]
    samples, stats = controller("rollout.temperature=1.0").build_samples(eps)
    assert stats.unusable == 1 and stats.zero_variance_groups == 1 and stats.groups == 2
    assert [s.episode_id for s in samples] == ["a", "b"]
    a = samples[0]
    assert a.token_ids == [1, 2, 3, 4, 9, 5] and a.loss_mask == [0, 0, 1, 1, 0, 1]
    assert a.advantages[2] == pytest.approx(1.0, abs=1e-4) and a.advantages[4] == 0.0
    assert samples[1].advantages[5] == pytest.approx(-1.0, abs=1e-4)


def test_reward_to_go_puts_each_turns_return_on_its_chunk():
    eps = [episode("a", "g", 1.0, process=[("a-c1", 0.5)]), episode("b", "g", 0.0)]
    cfg = ["rollout.temperature=1.0", "train.advantage.estimator=reward_to_go", "train.advantage.std_normalize=false"]
    samples, _ = controller(*cfg).build_samples(eps)
    # returns: a = [1.5, 1.0], b = [0, 0]; group mean over the 4 turns = 0.625
    a, b = samples
    assert a.advantages == pytest.approx([0, 0, 0.875, 0.875, 0, 0.375])
    assert b.advantages == pytest.approx([0, 0, -0.625, -0.625, 0, -0.625])
    assert a.chunk_ids == [0, 0, 0, 0, 1, 1]


def test_tempered_rollouts_compare_against_the_sampling_distribution():
    e = episode("a", "g", 1.0)
    e.calls[0].sample_logprobs = [-0.7, -0.8]
    samples, _ = controller("rollout.temperature=0.5").build_samples([e, episode("b", "g", 0.0)])
    assert samples[0].rollout_logprobs[2:4] == [-0.7, -0.8]
