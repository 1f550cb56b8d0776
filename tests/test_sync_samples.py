"""From scored episodes to trainer samples (train/samples.py): GRPO per episode, reward-to-go per turn
(C3/C4), zero-variance groups dropped and counted, infrastructure failures never trained on, a registered or
user estimator reached by name."""

from __future__ import annotations

import pytest
import torch

from arborl.config import AdvantageConfig
from arborl.rewards import ADVANTAGE_ESTIMATORS, broadcast_to_tokens
from arborl.train.samples import build_samples, turn_process_rewards
from arborl.types import Call, Episode, EpisodeStatus


def episode(eid: str, group: str, reward: float, process=(), status=EpisodeStatus.FINISHED, meta=None) -> Episode:
    # two stitched turns: prompt [1,2] -> [3,4]; then [1,2,3,4,9] -> [5]
    c1 = Call(eid, [1, 2], [3, 4], [-0.1, -0.2], [-0.15, -0.25], [0, 0], "stop", call_id=f"{eid}-c1")
    c2 = Call(eid, [1, 2, 3, 4, 9], [5], [-0.3], [-0.35], [0], "stop", call_id=f"{eid}-c2")
    rewards = [{"name": "p", "value": v, "call_id": cid, "after_call": None} for cid, v in process]
    return Episode(f"task-{eid}", group, status=status, episode_id=eid, calls=[c1, c2],
                   reward_components={"outcome": reward}, reward=reward, meta={"rewards": rewards, **(meta or {})})


def test_grpo_advantage_on_every_generated_token_and_zero_variance_dropped():
    eps = [episode("a", "g1", 1.0), episode("b", "g1", 0.0), episode("c", "g2", 1.0), episode("d", "g2", 1.0),
           episode("e", "g1", 0.0, status=EpisodeStatus.FAILED, meta={"infra_error": "worker died"})]
    samples, stats = build_samples(eps, AdvantageConfig())
    assert stats.unusable == 1 and stats.zero_variance_groups == 1 and stats.groups == 2
    assert [s.episode_id for s in samples] == ["a", "b"]
    a = samples[0]
    assert a.token_ids == [1, 2, 3, 4, 9, 5] and a.loss_mask == [0, 0, 1, 1, 0, 1]
    # rewards [1, 0]: mean 0.5, std with the n-1 convention (the default) sqrt(0.5)
    assert a.advantages[2] == pytest.approx(2 ** -0.5, abs=1e-4) and a.advantages[4] == 0.0
    assert samples[1].advantages[5] == pytest.approx(-(2 ** -0.5), abs=1e-4)
    assert a.group_id == "g1" and a.reward == 1.0 and a.call_ids == ["a-c1", "a-c2"]
    # the product's placement is the library's broadcast: the same values
    want = broadcast_to_tokens(torch.tensor([a.advantages[2]]), torch.tensor([a.loss_mask]))[0]
    assert a.advantages == pytest.approx(want.tolist(), abs=1e-5)


def test_an_agents_own_failure_is_a_low_reward_episode_an_infrastructure_failure_is_left_out():
    agent_failed = episode("f", "g", 0.0, status=EpisodeStatus.ABORTED)  # e.g. the agent's timeout
    infra = episode("i", "g", 1.0, status=EpisodeStatus.FAILED, meta={"infra_error": "sandbox did not start"})
    samples, stats = build_samples([episode("a", "g", 1.0), agent_failed, infra], AdvantageConfig())
    assert [s.episode_id for s in samples] == ["a", "f"] and stats.unusable == 1
    assert samples[1].advantages[2] < 0 < samples[0].advantages[2]  # the baseline is over a and f only
    assert samples[0].advantages[2] == pytest.approx(-samples[1].advantages[2], abs=1e-4)


def test_zero_variance_groups_are_kept_when_asked():
    eps = [episode("c", "g2", 1.0), episode("d", "g2", 1.0)]
    samples, stats = build_samples(eps, AdvantageConfig(drop_zero_variance=False))
    assert stats.zero_variance_groups == 0 and len(samples) == 2 and all(a == 0.0 for a in samples[0].advantages)


def test_reward_to_go_puts_each_turns_return_on_its_chunk():
    eps = [episode("a", "g", 1.0, process=[("a-c1", 0.5)]), episode("b", "g", 0.0)]
    samples, _ = build_samples(eps, AdvantageConfig(estimator="reward_to_go", std_normalize=False))
    # returns: a = [1.5, 1.0], b = [0, 0]; group mean over the 4 turns = 0.625
    a, b = samples
    assert a.advantages == pytest.approx([0, 0, 0.875, 0.875, 0, 0.375])
    assert b.advantages == pytest.approx([0, 0, -0.625, -0.625, 0, -0.625])
    assert a.chunk_ids == [0, 0, 0, 0, 1, 1]
    assert turn_process_rewards(eps[0]) == [0.5, 0.0]


def test_samples_keep_both_log_probs_and_the_trainer_picks_by_temperature():
    samples, _ = build_samples([episode("a", "g", 1.0), episode("b", "g", 0.0)], AdvantageConfig())
    s = samples[0]
    assert s.rollout_logprobs[2:4] == [-0.1, -0.2] and s.sample_logprobs[2:4] == [-0.15, -0.25]
    assert s.behaviour_logprobs(tempered=True)[2:4] == [-0.15, -0.25]
    assert s.behaviour_logprobs(tempered=False)[2:4] == [-0.1, -0.2]


def test_a_user_estimator_from_a_file_is_reached_by_its_path(tmp_path):
    f = tmp_path / "my_estimator.py"
    f.write_text("import torch\n\ndef best_only(rewards, turns, groups):\n"
                 "    return (rewards == rewards.max()).to(torch.float64) * 2.0\n")
    eps = [episode("a", "g", 1.0), episode("b", "g", 0.0)]
    samples, _ = build_samples(eps, AdvantageConfig(estimator=f"{f}:best_only"))
    assert samples[0].advantages == [0, 0, 2.0, 2.0, 0, 2.0] and samples[1].advantages == [0.0] * 6
    assert "grpo" in ADVANTAGE_ESTIMATORS and "reward_to_go" in ADVANTAGE_ESTIMATORS
