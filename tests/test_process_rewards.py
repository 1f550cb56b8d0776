"""Process rewards (C1) and the completion-time reward (C2) reach the tokens of the turn they belong to,
through build_samples, under every estimator; each shaping knob changes the advantages where it should
and not where it should not."""

from __future__ import annotations

import pytest
import torch

from arborl.config import AdvantageConfig, RewardShapingConfig
from arborl.rewards import ADVANTAGE_ESTIMATORS
from arborl.rewards.shaping import speed_rewards
from arborl.train.samples import build_samples, completion_cost, shaped_rewards
from arborl.types import Call, Episode, EpisodeStatus


def episode(eid: str, group: str, reward: float, *, process=(), gen=(2, 1), wall=1.0) -> Episode:
    """Two stitched turns: prompt [1,2] -> gen[0] tokens; then the whole so far + [9] -> gen[1] tokens."""
    a = list(range(100, 100 + gen[0]))
    b = list(range(200, 200 + gen[1]))
    c1 = Call(eid, [1, 2], a, [-0.1] * len(a), [-0.1] * len(a), [0] * len(a), "stop", call_id=f"{eid}-c1")
    c2 = Call(eid, [1, 2, *a, 9], b, [-0.2] * len(b), [-0.2] * len(b), [0] * len(b), "stop", call_id=f"{eid}-c2")
    rewards = [{"name": "p", "value": v, "call_id": f"{eid}-{c}", "after_call": None} for c, v in process]
    ep = Episode(f"task-{group}", group, status=EpisodeStatus.FINISHED, episode_id=eid, calls=[c1, c2],
                 reward_components={"outcome": reward}, reward=reward, meta={"rewards": rewards})
    ep.started_at, ep.finished_at = 100.0, 100.0 + wall
    return ep


def turn_values(sample):
    """{turn: the advantage on that turn's generated tokens} (one value per turn)."""
    out = {}
    for m, c, a in zip(sample.loss_mask, sample.chunk_ids, sample.advantages):
        if m:
            out.setdefault(c, set()).add(round(a, 12))
    assert all(len(v) == 1 for v in out.values()), out
    return {c: v.pop() for c, v in out.items()}


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "reward_to_go", "auto"])
def test_a_process_penalty_lands_on_its_own_turn_under_every_estimator(estimator):
    eps = [episode("a", "g", 1.0), episode("b", "g", 1.0, process=[("c1", -1.0)]), episode("c", "g", 0.0),
           episode("d", "g", 0.0)]
    samples, stats = build_samples(eps, AdvantageConfig(estimator=estimator))
    off, _ = build_samples(eps, AdvantageConfig(estimator=estimator, shaping=RewardShapingConfig(process_weight=0)))
    on = {s.episode_id: turn_values(s) for s in samples}
    ref = {s.episode_id: turn_values(s) for s in off}
    # b's first turn (the penalised call) is now below a's first turn; a and b had equal outcomes
    assert on["b"][0] < on["a"][0] - 0.1
    assert on["b"][0] < ref["b"][0]
    if estimator in ("grpo", "rloo"):  # outcome advantage + the turn's process term: b's second turn is a's
        assert on["b"][1] == pytest.approx(on["a"][1])
    assert stats.samples == 4


def test_process_rewards_keep_a_group_whose_outcomes_are_equal():
    eps = [episode("a", "g", 1.0), episode("b", "g", 1.0, process=[("c2", 0.5)])]
    samples, stats = build_samples(eps, AdvantageConfig(estimator="grpo"))
    assert stats.zero_variance_groups == 0 and len(samples) == 2
    a, b = (turn_values(s) for s in samples)
    assert b[1] > 0 > a[1] and a[0] == pytest.approx(b[0])  # only the rewarded turn differs
    # without the process reward (weight 0) the group carries nothing and is dropped
    _, stats = build_samples(eps, AdvantageConfig(estimator="grpo", shaping=RewardShapingConfig(process_weight=0)))
    assert stats.zero_variance_groups == 1


def test_speed_reward_formula():
    # group g: costs 10, 20, 30 (mean 20); group h: one eligible episode, nothing to compare with
    assert speed_rewards([10, 20, 30, 5], ["g", "g", "g", "h"]) == pytest.approx([0.5, 0.0, -0.5, 0.0])
    assert speed_rewards([10, 20, 30], ["g"] * 3, [True, False, True]) == pytest.approx([0.5, 0.0, -0.5])
    assert speed_rewards([1, 100], ["g", "g"]) == pytest.approx([49.5 / 50.5, -49.5 / 50.5])
    assert speed_rewards([0, 0], ["g", "g"]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="eligibility"):
        speed_rewards([1, 2], ["g", "g"], [True])


@pytest.mark.parametrize("metric,costs", [("tokens", [3.0, 6.0]), ("turns", [2.0, 2.0]), ("wall_time", [1.0, 4.0])])
def test_completion_cost_metrics(metric, costs):
    eps = [episode("a", "g", 1.0, gen=(2, 1), wall=1.0), episode("b", "g", 1.0, gen=(4, 2), wall=4.0)]
    assert [completion_cost(e, metric) for e in eps] == costs


def test_speed_reward_reaches_the_last_turn_and_its_knobs_change_it():
    # both succeed; b generates twice the tokens and takes four times the wall time
    eps = [episode("a", "g", 1.0, gen=(2, 1), wall=1.0), episode("b", "g", 1.0, gen=(4, 2), wall=4.0),
           episode("c", "g", 0.0, gen=(1, 1), wall=0.5), episode("d", "g", 0.0, gen=(8, 8), wall=9.0)]
    sh = RewardShapingConfig(speed_weight=0.5)
    shaped, turns = shaped_rewards(eps, sh)
    # tokens: a 3, b 6 among the successful -> mean 4.5, s = +1/3, -1/3; failures get no speed reward
    assert shaped == pytest.approx([1 + 0.5 / 3, 1 - 0.5 / 3, 0.0, 0.0])
    assert turns[0] == pytest.approx([0.0, 1 + 0.5 / 3])  # on the last turn, with the outcome
    assert shaped_rewards(eps, sh.model_copy(update={"speed_metric": "wall_time"}))[0][:2] == pytest.approx([1.3, 0.7])
    assert shaped_rewards(eps, sh.model_copy(update={"speed_metric": "turns"}))[0][:2] == pytest.approx([1.0, 1.0])
    every = shaped_rewards(eps, sh.model_copy(update={"speed_success_only": False}))[0]
    assert every[2] > 0 > every[3]  # now the fast failure is paid for finishing fast
    assert shaped_rewards(eps, RewardShapingConfig())[0] == [1.0, 1.0, 0.0, 0.0]  # speed off by default
    # on the tokens: with equal outcomes, the faster success gets the larger advantage on every turn
    samples, _ = build_samples(eps, AdvantageConfig(estimator="grpo", shaping=sh))
    a, b = (turn_values(s) for s in samples[:2])
    assert a[0] > b[0] and a[1] > b[1]
    plain, _ = build_samples(eps, AdvantageConfig(estimator="grpo"))
    assert turn_values(plain[0])[0] == pytest.approx(turn_values(plain[1])[0])


def test_outcome_and_process_weights_scale_their_parts():
    eps = [episode("a", "g", 1.0, process=[("c1", -0.5)]), episode("b", "g", 0.0)]
    _, turns = shaped_rewards(eps, RewardShapingConfig(process_weight=2.0, outcome_weight=3.0))
    assert turns == [pytest.approx([-1.0, 3.0]), pytest.approx([0.0, 0.0])]
    _, turns = shaped_rewards(eps, RewardShapingConfig(process_weight=0.0))
    assert turns[0] == pytest.approx([0.0, 1.0])


def test_auto_picks_reward_to_go_for_process_rewards():
    eps = [episode("a", "g", 1.0, process=[("c1", 0.5)]), episode("b", "g", 0.0)]
    auto, _ = build_samples(eps, AdvantageConfig(settings={"gamma": 0.5}))
    rtg, _ = build_samples(eps, AdvantageConfig(estimator="reward_to_go", settings={"gamma": 0.5}))
    assert [s.advantages for s in auto] == [s.advantages for s in rtg]
    assert "auto" in ADVANTAGE_ESTIMATORS and torch.is_tensor(torch.tensor(auto[0].advantages))


def test_partial_credit_components_lift_the_reward_but_not_success():
    """shaping.component_weights: code_repair's tests_passed_frac gives an episode passing 3 of 4 hidden tests
    more reward than one that breaks the repository; its success (outcome) is unchanged, and so is who counts
    as successful for the speed reward."""
    from arborl.rewards.shaping import task_reward

    three_of_four = {"outcome": 0.0, "tests_passed_frac": 0.75}
    broken = {"outcome": 0.0, "tests_passed_frac": 0.0}
    solved = {"outcome": 1.0, "tests_passed_frac": 1.0}
    w = {"tests_passed_frac": 0.5}
    assert [task_reward(c, {}) for c in (three_of_four, broken, solved)] == [0.0, 0.0, 1.0]
    assert [task_reward(c, w) for c in (three_of_four, broken, solved)] == [0.375, 0.0, 1.5]
    assert task_reward({"outcome": 1.0}, w) == 1.0  # not reported: counts 0
    # a partial episode with a large weight reaches reward 1 without success: the speed reward still skips it
    partial = episode("p", "g", task_reward(three_of_four, {"tests_passed_frac": 2.0}), gen=(1, 1))
    partial.reward_components = three_of_four
    eps = [episode("a", "g", 1.0, gen=(2, 1)), episode("b", "g", 1.0, gen=(4, 2)), partial]
    shaped, _ = shaped_rewards(eps, RewardShapingConfig(speed_weight=0.5))
    assert shaped[2] == pytest.approx(1.5)  # its reward, no speed term although it was the fastest
    # and the groups' advantages now tell the partial episode from the broken one
    eps = [episode("x", "g", task_reward(three_of_four, w)), episode("y", "g", task_reward(broken, w))]
    samples, _ = build_samples(eps, AdvantageConfig(estimator="grpo"))
    assert turn_values(samples[0])[1] > 0 > turn_values(samples[1])[1]


def test_component_weights_reach_a_runs_episode_rewards(tmp_path):
    """The knob through a real run: even_tokens reports its outcome only, so weighting ``outcome`` once more
    doubles every episode's reward in the data pool."""
    from arborl.datapool import DataPool
    from arborl.run.job import train
    from helpers.tiny_run import tiny_cfg

    cfg = tiny_cfg(tmp_path, "partial", "rollout.steps=1", "train.advantage.shaping.component_weights={outcome: 1.0}")
    train(cfg)
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        eps = [e for e in pool.episodes(with_calls=False) if e.reward_components]
    assert eps and any(e.reward_components["outcome"] > 0 for e in eps)
    assert all(e.reward == pytest.approx(2 * e.reward_components["outcome"]) for e in eps)
