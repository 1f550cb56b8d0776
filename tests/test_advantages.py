"""rewards/: GRPO / Dr.GRPO, zero-variance groups, reward-to-go (C3), chunk broadcast (C4), outcome helpers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arborl.config import AdvantageConfig, Config
from arborl.rewards import (
    broadcast_to_tokens,
    grpo_advantages,
    pad_turns,
    reward_to_go,
    reward_to_go_advantages,
    subtract_baseline,
    turn_rewards,
    zero_variance_groups,
    zero_variance_mask,
)

F64 = torch.float64
SETTINGS = settings(max_examples=80, deadline=None)


# ---------------------------------------------------------------- references


def ref_group_stats(values, groups):
    """{group: (mean, population std)} by loops."""
    out = {}
    for g in dict.fromkeys(groups):
        vs = [v for v, h in zip(values, groups) if h == g]
        mean = sum(vs) / len(vs)
        out[g] = (mean, math.sqrt(sum((v - mean) ** 2 for v in vs) / len(vs)))
    return out


def ref_grpo(rewards, groups, std_normalize, eps):
    stats = ref_group_stats(rewards, groups)
    return [(r - stats[g][0]) / ((stats[g][1] + eps) if std_normalize else 1.0) for r, g in zip(rewards, groups)]


def ref_rtg(turns, gamma):
    return [[sum(gamma ** (k - t) * rs[k] for k in range(t, len(rs))) for t in range(len(rs))] for rs in turns]


# ---------------------------------------------------------------- GRPO

rewards_and_groups = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5)), min_size=n, max_size=n),
        st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=n, max_size=n),
    )
)


@SETTINGS
@given(rewards_and_groups, st.booleans())
def test_grpo_matches_reference_zero_mean_unit_std(rg, std_normalize):
    rewards, groups = rg
    eps = 1e-6
    adv = grpo_advantages(torch.tensor(rewards, dtype=F64), groups, std_normalize=std_normalize, eps=eps)
    assert adv.tolist() == pytest.approx(ref_grpo(rewards, groups, std_normalize, eps), rel=1e-9, abs=1e-9)
    stats = ref_group_stats(rewards, groups)
    a_stats = ref_group_stats(adv.tolist(), groups)
    for g, (mean, std) in stats.items():
        assert a_stats[g][0] == pytest.approx(0.0, abs=1e-9)  # zero mean within every group
        if std_normalize:
            assert a_stats[g][1] == pytest.approx(std / (std + eps), rel=1e-7, abs=1e-9)
            if std > 1e-3:
                assert a_stats[g][1] == pytest.approx(1.0, rel=1e-3)  # unit std when the group varies
        else:
            assert a_stats[g][1] == pytest.approx(std, rel=1e-9, abs=1e-12)  # Dr.GRPO: plain centring


def test_grpo_degenerate_groups_and_inputs():
    # single-sample group and an all-equal group: A = 0, never NaN
    adv = grpo_advantages([1.0, 0.3, 0.3, 0.3, 1.0, 0.0], ["solo", "same", "same", "same", "x", "x"])
    assert adv[:4].tolist() == [0.0] * 4
    assert adv[4].item() == pytest.approx(1.0, rel=1e-5) and adv[5].item() == pytest.approx(-1.0, rel=1e-5)
    # group ids as a tensor, rewards as a list of ints; result is floating
    adv = grpo_advantages([1, 0, 0, 0], torch.tensor([7, 7, 3, 3]), std_normalize=False)
    assert adv.dtype == torch.get_default_dtype() and adv.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert grpo_advantages([], []).numel() == 0
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages([1.0, 2.0], ["a"])


@SETTINGS
@given(rewards_and_groups)
def test_zero_variance_groups_match_reference(rg):
    rewards, groups = rg
    expect = [g for g in dict.fromkeys(groups) if len({r for r, h in zip(rewards, groups) if h == g}) == 1]
    assert zero_variance_groups(rewards, groups) == expect
    assert zero_variance_mask(rewards, groups).tolist() == [g in expect for g in groups]


def test_zero_variance_is_exact_despite_rounding_and_honours_tol():
    # 0.1 three times: the float mean is not exactly 0.1, but max == min
    assert zero_variance_groups([0.1, 0.1, 0.1, 1.0, 1.0 + 1e-9], ["a", "a", "a", "b", "b"]) == ["a"]
    assert zero_variance_groups([0.1, 0.1, 0.1, 1.0, 1.0 + 1e-9], ["a", "a", "a", "b", "b"], tol=1e-6) == ["a", "b"]


# ---------------------------------------------------------------- reward-to-go (C3)

ragged_turns = st.lists(st.lists(st.floats(-3, 3), max_size=6), min_size=1, max_size=8)


@SETTINGS
@given(ragged_turns, st.sampled_from([1.0, 0.9, 0.0]))
def test_reward_to_go_matches_reference(turns, gamma):
    got = reward_to_go(turns, gamma=gamma)
    expect = ref_rtg(turns, gamma)
    for n, rs in enumerate(expect):
        assert got[n, : len(rs)].tolist() == pytest.approx(rs, rel=1e-5, abs=1e-5)
        assert got[n, len(rs):].abs().sum().item() == 0.0  # padding stays 0


def test_reward_to_go_padded_tensor_ignores_junk_padding():
    turns = [[0.0, 0.5, 1.0], [1.0], []]
    padded, tmask = pad_turns(turns, dtype=F64)
    junk = torch.where(tmask, padded, torch.tensor(99.0, dtype=F64))
    got = reward_to_go(junk, gamma=0.5, turn_mask=tmask)
    assert got.tolist() == [[0.0 + 0.5 * 1.0, 0.5 + 0.5 * 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert got.dtype == F64
    # only an outcome at the last turn, gamma = 1: every turn's return is the outcome
    assert reward_to_go([turn_rewards(1.0, 4)]).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        reward_to_go(torch.zeros(3))


@SETTINGS
@given(ragged_turns.flatmap(lambda t: st.tuples(st.just(t), st.lists(st.sampled_from("xy"), min_size=len(t), max_size=len(t)))),
       st.booleans())
def test_reward_to_go_advantages_group_baseline_matches_reference(tg, std_normalize):
    turns, groups = tg
    rtg = ref_rtg(turns, 1.0)
    pooled = [v for rs in rtg for v in rs]
    pooled_groups = [g for rs, g in zip(rtg, groups) for _ in rs]
    stats = ref_group_stats(pooled, pooled_groups) if pooled else {}
    got = reward_to_go_advantages([[float(x) for x in rs] for rs in turns], groups, std_normalize=std_normalize)
    for n, rs in enumerate(rtg):
        if not rs:
            continue
        mean, std = stats[groups[n]]
        expect = [(v - mean) / ((std + 1e-6) if std_normalize else 1.0) for v in rs]
        assert got[n, : len(rs)].tolist() == pytest.approx(expect, rel=1e-4, abs=1e-4)
    # zero mean over every group's valid turns
    _, tmask = pad_turns(turns)
    for g in set(groups):
        rows = torch.tensor([h == g for h in groups])
        sel = got[rows][tmask[rows]]
        if sel.numel():
            assert sel.double().mean().item() == pytest.approx(0.0, abs=1e-4)


def test_subtract_baseline_explicit_baselines():
    returns = torch.tensor([[3.0, 2.0, 1.0], [4.0, 0.0, 0.0]], dtype=F64)
    tmask = torch.tensor([[True, True, True], [True, False, False]])
    assert subtract_baseline(returns, baseline=1.0, turn_mask=tmask).tolist() == [[2.0, 1.0, 0.0], [3.0, 0.0, 0.0]]
    per_sample = torch.tensor([1.0, 2.0], dtype=F64)
    assert subtract_baseline(returns, baseline=per_sample, turn_mask=tmask).tolist() == [[2.0, 1.0, 0.0], [2.0, 0.0, 0.0]]
    per_turn = torch.full((2, 3), 0.5, dtype=F64)
    assert subtract_baseline(returns, baseline=per_turn).tolist() == [[2.5, 1.5, 0.5], [3.5, -0.5, -0.5]]
    # group mean over the valid turns only: (3 + 2 + 1 + 4) / 4 = 2.5
    assert subtract_baseline(returns, ["g", "g"], turn_mask=tmask).tolist() == [[0.5, -0.5, -1.5], [1.5, 0.0, 0.0]]
    with pytest.raises(ValueError, match="group_ids"):
        subtract_baseline(returns)
    with pytest.raises(ValueError, match="std_normalize"):
        subtract_baseline(returns, baseline=1.0, std_normalize=True)


# ---------------------------------------------------------------- onto tokens (C4)


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 4), st.data())
def test_broadcast_to_tokens_matches_reference(N, T, K, data):
    values = data.draw(st.lists(st.lists(st.floats(-4, 4), min_size=K, max_size=K), min_size=N, max_size=N))
    mask = data.draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=N, max_size=N))
    # chunk ids: any value off the mask (even out of range), in [0, K) on it
    chunks = [[data.draw(st.integers(0, K - 1)) if mask[n][t] else data.draw(st.integers(-3, K + 3)) for t in range(T)]
              for n in range(N)]
    got = broadcast_to_tokens(torch.tensor(values, dtype=F64), torch.tensor(mask), torch.tensor(chunks))
    expect = [[values[n][chunks[n][t]] if mask[n][t] else 0.0 for t in range(T)] for n in range(N)]
    assert got.tolist() == expect
    per_sample = broadcast_to_tokens(torch.tensor([v[0] for v in values], dtype=F64), torch.tensor(mask))
    assert per_sample.tolist() == [[values[n][0] if mask[n][t] else 0.0 for t in range(T)] for n in range(N)]


def test_broadcast_errors_and_empty():
    mask = torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match="chunk id 2 outside"):
        broadcast_to_tokens(torch.tensor([[1.0, 2.0]]), mask, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="need chunk_ids"):
        broadcast_to_tokens(torch.tensor([[1.0, 2.0]]), mask)
    # a sample with no turns and no loss tokens
    assert broadcast_to_tokens(torch.zeros(1, 0), torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long)).tolist() == [[0.0] * 3]


def test_end_to_end_turn_rewards_to_token_advantages():
    """Two episodes of one group: per-turn rewards -> reward-to-go advantages -> tokens by chunk id."""
    turns = [turn_rewards(1.0, 2, process=[-0.1, 0.0]), turn_rewards(0.0, 1)]
    adv = reward_to_go_advantages(turns, ["g", "g"], gamma=1.0)
    # returns: ep0 [0.9, 1.0], ep1 [0.0]; group mean 1.9 / 3
    b = 1.9 / 3
    assert adv.flatten().tolist() == pytest.approx([0.9 - b, 1.0 - b, 0.0 - b, 0.0])
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]])
    chunks = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    tok = broadcast_to_tokens(adv, mask, chunks)
    assert tok.flatten().tolist() == pytest.approx([0, 0.9 - b, 0.9 - b, 0, 1.0 - b, 0, -b, -b, 0, 0])


# ---------------------------------------------------------------- outcome helpers and config


def test_outcome_helpers():
    assert turn_rewards(2.0, 3) == [0.0, 0.0, 2.0]
    assert turn_rewards(1.0, 2, process=[-0.1, -0.2]) == pytest.approx([-0.1, 0.8])
    assert turn_rewards(1.0, 0) == []
    with pytest.raises(ValueError, match="process rewards"):
        turn_rewards(1.0, 2, process=[0.0])


def test_train_config_sections_exist_with_defaults():
    cfg = Config()
    assert cfg.train.advantage == AdvantageConfig()
    assert cfg.train.loss.kind == "ppo" and cfg.train.correction.mode == "none"
    assert cfg.train.advantage.std_normalize is True and cfg.train.loss.aggregation == "token_mean"
