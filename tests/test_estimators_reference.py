"""RLOO, REINFORCE++ (and its baseline variant), GRPO's std convention and process rewards under every
estimator, against float64 references written as plain loops (statistics module), and one test per knob
that it changes the advantages where it should and not where it should not."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from arborl.config import AdvantageConfig, Config, load_config, ConfigError
from arborl.extensions import check_extensions
from arborl.rewards import ADVANTAGE_ESTIMATORS, estimate, grpo_advantages, resolve_estimator, rloo_advantages, turn_rewards, whiten

EPS = 1e-6


def batch(seed: int, groups: int = 3, size: int = 4, process: bool = False):
    """(outcome rewards, per-turn rewards, process rewards, group ids): ragged turns, outcomes in {0, 1}."""
    rng = random.Random(seed)
    R, turns, proc, gids = [], [], [], []
    for g in range(groups):
        for _ in range(size):
            k = rng.randint(1, 4)
            r = float(rng.random() < 0.5) + rng.choice([0.0, 0.25])
            p = [rng.choice([0.0, -0.2, 0.3]) if process else 0.0 for _ in range(k)]
            R.append(r)
            proc.append(p)
            turns.append(turn_rewards(r, k, p))
            gids.append(f"g{g}")
    return R, turns, proc, gids


def members(gids, g):
    return [i for i, x in enumerate(gids) if x == g]


def ref_grpo(R, gids, unbiased=True, normalize=True):
    out = []
    for i, g in enumerate(gids):
        vals = [R[j] for j in members(gids, g)]
        mean = statistics.fmean(vals)
        sd = (statistics.stdev(vals) if unbiased else statistics.pstdev(vals)) if len(vals) > 1 else 0.0
        out.append((R[i] - mean) / (sd + EPS) if normalize else R[i] - mean)
    return out


def ref_rloo(R, gids):
    out = []
    for i, g in enumerate(gids):
        others = [R[j] for j in members(gids, g) if j != i]
        out.append(R[i] - statistics.fmean(others) if others else 0.0)
    return out


def ref_returns(turns, gamma):
    return [[sum(gamma ** (j - k) * rs[j] for j in range(k, len(rs))) for k in range(len(rs))] for rs in turns]


def ref_whiten(rows):
    flat = [v for r in rows for v in r]
    mean, sd = statistics.fmean(flat), statistics.stdev(flat)
    return [[(v - mean) / (sd + EPS) for v in r] for r in rows]


def padded(rows, k):
    return [list(r) + [0.0] * (k - len(r)) for r in rows]


def close(got, expect, tol=1e-10):
    """Nested float64 comparison (pytest.approx takes flat lists only)."""
    assert torch.allclose(got, torch.tensor(expect, dtype=torch.float64), rtol=tol, atol=tol), (got, expect)


def run(name, R, turns, gids, gamma=None, **cfg):
    """The estimator as the trainer calls it: its own settings (gamma) and the shared normalisation knobs."""
    settings = {} if gamma is None else {"gamma": gamma}
    return estimate(AdvantageConfig(estimator=name, settings=settings, **cfg), torch.tensor(R, dtype=torch.float64),
                    turns, gids)


# ------------------------------------------------------------------------------ outcome-only estimators


@pytest.mark.parametrize("seed", range(5))
def test_grpo_default_std_is_unbiased_and_population_is_a_knob(seed):
    R, turns, _, gids = batch(seed)
    got = run("grpo", R, turns, gids)
    assert got.dim() == 1 and got.tolist() == pytest.approx(ref_grpo(R, gids, unbiased=True), rel=1e-12, abs=1e-12)
    pop = run("grpo", R, turns, gids, std="population")
    assert pop.tolist() == pytest.approx(ref_grpo(R, gids, unbiased=False), rel=1e-12, abs=1e-12)
    # the knob changes normalised advantages of varying groups, and nothing without std normalisation
    varying = [i for i, g in enumerate(gids) if len({R[j] for j in members(gids, g)}) > 1]
    assert varying and all(abs(got[i] - pop[i]) > 1e-3 for i in varying)
    assert run("grpo", R, turns, gids, std_normalize=False).tolist() == \
        run("grpo", R, turns, gids, std_normalize=False, std="population").tolist()
    # the function keeps its population default (callers that pass nothing get what they got)
    assert grpo_advantages(torch.tensor(R, dtype=torch.float64), gids).tolist() == pytest.approx(pop.tolist(), abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_rloo_matches_reference(seed):
    R, turns, _, gids = batch(seed)
    got = run("rloo", R, turns, gids)
    assert got.tolist() == pytest.approx(ref_rloo(R, gids), rel=1e-12, abs=1e-12)
    # = G/(G-1) x the centred reward; a group of one gets 0
    assert rloo_advantages([1.0, 0.0, 0.0, 5.0], ["a", "a", "a", "solo"]).tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_reinforce_pp_matches_reference(seed, gamma):
    R, turns, _, gids = batch(seed, process=True)
    got = run("reinforce_pp", R, turns, gids, gamma=gamma)
    expect = padded(ref_whiten(ref_returns(turns, gamma)), got.shape[1])
    close(got, expect)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_reinforce_pp_baseline_matches_reference(seed, gamma):
    R, turns, _, gids = batch(seed, process=True)
    got = run("reinforce_pp_baseline", R, turns, gids, gamma=gamma)
    G = ref_returns(turns, gamma)
    centred = []
    for n, g in enumerate(gids):
        pool = [v for j in members(gids, g) for v in G[j]]
        centred.append([v - statistics.fmean(pool) for v in G[n]])
    close(got, padded(ref_whiten(centred), got.shape[1]))


def test_reinforce_pp_baseline_is_verls_outcome_form_for_single_turn_episodes():
    R = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    gids = ["a"] * 4 + ["b"] * 4
    got = run("reinforce_pp_baseline", R, [[r] for r in R], gids)
    centred = [R[i] - statistics.fmean(R[j] for j in members(gids, g)) for i, g in enumerate(gids)]
    assert got[:, 0].tolist() == pytest.approx([v[0] for v in ref_whiten([[c] for c in centred])], abs=1e-12)
    assert whiten(torch.tensor(centred, dtype=torch.float64)).tolist() == pytest.approx(got[:, 0].tolist(), abs=1e-12)


def test_gamma_changes_reinforce_pp_only_for_episodes_with_several_turns():
    R, turns, _, gids = batch(3, process=True)
    a, b = run("reinforce_pp", R, turns, gids, gamma=1.0), run("reinforce_pp", R, turns, gids, gamma=0.5)
    assert not torch.allclose(a, b)
    single = [[r] for r in R]
    assert torch.equal(run("reinforce_pp", R, single, gids, gamma=1.0), run("reinforce_pp", R, single, gids, gamma=0.5))


# ------------------------------------------------------------------------------ process rewards (C1)


def ref_with_process(A, proc, gids, unbiased=True):
    """A_{n,k} = A_n + (p_{n,k} - mean_g p) / (std_g p + eps), mean and std pooled over the group's turns."""
    out = []
    for n, g in enumerate(gids):
        pool = [v for j in members(gids, g) for v in proc[j]]
        mean = statistics.fmean(pool)
        sd = statistics.stdev(pool) if unbiased else statistics.pstdev(pool)
        out.append([A[n] + (v - mean) / (sd + EPS) for v in proc[n]])
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name,ref", [("grpo", ref_grpo), ("rloo", ref_rloo)])
def test_process_rewards_under_per_episode_estimators_match_reference(seed, name, ref):
    R, turns, proc, gids = batch(seed, process=True)
    got = run(name, R, turns, gids)
    expect = padded(ref_with_process(ref(R, gids), proc, gids), got.shape[1])
    assert got.dim() == 2
    close(got, expect, 1e-9)


def test_a_process_reward_moves_only_its_own_turn_under_grpo():
    R = [1.0, 0.0, 1.0, 0.0]
    gids = ["g"] * 4
    plain = run("grpo", R, [turn_rewards(r, 3) for r in R], gids)
    assert plain.dim() == 1  # no process reward anywhere: GRPO exactly as before, one value per episode
    proc = [[0.0, 0.0, 0.0], [0.0, -0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    got = run("grpo", R, [turn_rewards(r, 3, p) for r, p in zip(R, proc)], gids)
    # episode 1's penalised turn is the only one below the others; every turn keeps the outcome advantage
    diff = got - plain[:, None]
    assert diff[1, 1] < -1.0 and torch.allclose(diff[[0, 2, 3]], diff[0, 0].expand(3, 3))
    assert torch.allclose(diff[1, [0, 2]], diff[0, 0].expand(2))
    assert diff[0, 0] > 0  # the unpenalised turns are a little above the group's mean process reward


def test_auto_is_grpo_without_process_rewards_and_discounted_reward_to_go_with_them():
    R, turns, proc, gids = batch(1, process=False)
    assert torch.equal(run("auto", R, turns, gids), run("grpo", R, turns, gids))
    R, turns, proc, gids = batch(1, process=True)
    got = run("auto", R, turns, gids, gamma=0.5)
    assert torch.allclose(got, run("reward_to_go", R, turns, gids, gamma=0.5))
    # auto's own gamma (default 0.9) acts, and only where process rewards exist
    assert not torch.allclose(got, run("auto", R, turns, gids))
    assert torch.allclose(run("auto", R, turns, gids), run("reward_to_go", R, turns, gids, gamma=0.9))
    R0, t0, _, g0 = batch(1, process=False)
    assert torch.equal(run("auto", R0, t0, g0, gamma=0.5), run("auto", R0, t0, g0, gamma=0.9))


def test_an_estimator_takes_its_own_settings_checked_like_a_loss_kind():
    """train.advantage.settings is checked against the chosen estimator's Settings model before any work,
    and the flat keys it replaced say where they went."""
    assert resolve_estimator(AdvantageConfig(estimator="reward_to_go"))[1] == {"gamma": 1.0}
    assert resolve_estimator(AdvantageConfig(estimator="auto"))[1] == {"gamma": 0.9}
    assert resolve_estimator(AdvantageConfig(estimator="grpo"))[1] == {}
    with pytest.raises(ConfigError, match="train.advantage.settings.gamma: not a setting of "
                                          "train.advantage.estimator=grpo; it has none"):
        resolve_estimator(AdvantageConfig(estimator="grpo", settings={"gamma": 0.5}))
    with pytest.raises(ConfigError, match="train.advantage.settings.gamma: Input should be less than or equal to 1"):
        resolve_estimator(AdvantageConfig(estimator="reward_to_go", settings={"gamma": 2}))
    with pytest.raises(ConfigError, match="train.advantage.settings.gama: not a setting of "
                                          "train.advantage.estimator=reinforce_pp; its settings are gamma"):
        check_extensions(load_config(None, ["train.advantage.estimator=reinforce_pp",
                                            "train.advantage.settings.gama=0.5"]))
    for old in ("gamma", "auto_gamma"):
        with pytest.raises(ConfigError, match=f"{old} moved: set train.advantage.settings.gamma"):
            load_config(None, [f"train.advantage.{old}=0.5"])


def test_config_defaults_and_group_relative_estimators():
    cfg = Config().train.advantage
    assert cfg.estimator == "auto" and cfg.std == "unbiased" and resolve_estimator(cfg)[1]["gamma"] < 1.0
    for name in ("rloo", "reinforce_pp", "reinforce_pp_baseline", "auto"):
        assert name in ADVANTAGE_ESTIMATORS
    for name in ("rloo", "reinforce_pp_baseline", "auto"):
        with pytest.raises(ConfigError, match="group_size=1"):
            load_config(None, ["rollout.group_size=1", f"train.advantage.estimator={name}"])
    # REINFORCE++ normalises over the batch, so single episodes per task are fine
    assert load_config(None, ["rollout.group_size=1", "train.advantage.estimator=reinforce_pp"]).rollout.group_size == 1
    with pytest.raises(ConfigError, match="train.advantage.std"):
        load_config(None, ["train.advantage.std=n-1"])
