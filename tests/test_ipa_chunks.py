"""C4 chunked MDP (ROLL's IPA): the chunk_returns estimator against a float64 reference written here, its
placement on the chunks' tokens through build_samples, and the ipa loss in a real trainer step (a chunk
whose train/rollout mismatch exceeds H contributes no gradient)."""

from __future__ import annotations

import random

import pytest
import torch

from arborl.config import AdvantageConfig, LossConfig, TrainConfig
from arborl.models import tiny_llama
from arborl.rewards import estimate
from arborl.rewards.chunk_returns import chunk_return_advantages, chunk_returns
from arborl.train.samples import build_samples
from arborl.train.trainer import Trainer
from arborl.types import Call, Episode, EpisodeStatus, Sample


def ref_advantages(rewards, chunks, groups, gamma, std_normalize, eps=1e-6):
    """G_{n,k} = gamma^(K_n - 1 - k) R_n; minus the mean over every chunk of the group (/ its population std)."""
    g = [[gamma ** (k_n - 1 - k) * r for k in range(k_n)] for r, k_n in zip(rewards, chunks)]
    out = []
    for n, grp in enumerate(groups):
        pool = [x for m, row in enumerate(g) if groups[m] == grp for x in row]
        mean = sum(pool) / len(pool)
        std = (sum((x - mean) ** 2 for x in pool) / len(pool)) ** 0.5
        out.append([(x - mean) / (std + eps) if std_normalize else x - mean for x in g[n]])
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5, 0.0])
@pytest.mark.parametrize("std_normalize", [False, True])
def test_chunk_returns_match_reference(gamma, std_normalize):
    rng = random.Random(3)
    rewards = [rng.choice([0.0, 1.0, 0.5]) for _ in range(9)]
    chunks = [rng.randint(1, 5) for _ in range(9)]
    groups = ["a", "b", "c"] * 3
    want = ref_advantages(rewards, chunks, groups, gamma, std_normalize)
    got = chunk_return_advantages(rewards, chunks, groups, gamma=gamma, std_normalize=std_normalize)
    est = estimate(AdvantageConfig(estimator="chunk_returns", settings={"gamma": gamma}, std_normalize=std_normalize),
                   torch.tensor(rewards, dtype=torch.float64), [[0.0] * k for k in chunks], groups)
    for n, row in enumerate(want):
        assert got[n, : len(row)].tolist() == pytest.approx(row, rel=1e-12, abs=1e-12)
        assert got[n, len(row):].abs().sum() == 0  # nothing past the episode's last chunk
        assert est[n, : len(row)].tolist() == pytest.approx(row, rel=1e-12, abs=1e-12)


def test_gamma_discounts_by_distance_to_the_end_and_only_there():
    g, mask = chunk_returns([2.0, 1.0], [3, 1], gamma=0.5)
    assert g.tolist() == [[0.5, 1.0, 2.0], [1.0, 0.0, 0.0]] and mask.tolist() == [[True] * 3, [True, False, False]]
    # single-chunk episodes: gamma has nothing to discount
    one = [chunk_return_advantages([1.0, 0.0, 1.0], [1, 1, 1], [0, 0, 0], gamma=x) for x in (1.0, 0.3)]
    assert torch.equal(one[0], one[1])
    with pytest.raises(ValueError, match="gamma"):
        chunk_returns([1.0], [2], gamma=1.5)


def episode(eid: str, group: str, reward: float, turns: int) -> Episode:
    """``turns`` stitched calls: each prompt is the previous context plus an observation token 9."""
    calls, ctx = [], [1, 2]
    for k in range(turns):
        out = [10 + k, 20 + k]
        calls.append(Call(eid, list(ctx), out, [-0.1, -0.2], [-0.1, -0.2], [0, 0], "stop", call_id=f"{eid}-c{k}"))
        ctx = ctx + out + [9]
    return Episode(f"task-{eid}", group, status=EpisodeStatus.FINISHED, episode_id=eid, calls=calls,
                   reward_components={"outcome": reward},
                   reward=reward, meta={"rewards": []})


def test_build_samples_places_each_chunk_return_on_its_chunk():
    eps = [episode("a", "g", 1.0, 3), episode("b", "g", 0.0, 2), episode("c", "g", 1.0, 1)]
    cfg = AdvantageConfig(estimator="chunk_returns", settings={"gamma": 0.5}, std_normalize=False)
    samples, _ = build_samples(eps, cfg)
    want = ref_advantages([1.0, 0.0, 1.0], [3, 2, 1], ["g"] * 3, 0.5, False)
    assert [s.episode_id for s in samples] == ["a", "b", "c"]
    for s, row in zip(samples, want):
        for t, (m, c) in enumerate(zip(s.loss_mask, s.chunk_ids)):
            assert s.advantages[t] == pytest.approx(row[c] if m else 0.0, abs=1e-12)


# ---------------------------------------------------------------- the ipa loss in a trainer step

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is faster


def two_chunk_samples(seed: int) -> list[Sample]:
    """prompt | completion (chunk 0) | observation | completion (chunk 1), per-chunk advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(4):
        p, c0, o, c1 = ([rng.randrange(VOCAB) for _ in range(n)] for n in (3, 4, 2, 5))
        toks = p + c0 + o + c1
        mask = [0] * 3 + [1] * 4 + [0] * 2 + [1] * 5
        chunk = [0] * 7 + [1] * 7
        a0, a1 = rng.uniform(0.3, 1.0), rng.uniform(0.3, 1.0)
        adv = [(a0 if c == 0 else a1) * m for c, m in zip(chunk, mask)]
        out.append(Sample(f"e{i}", f"g{i % 2}", toks, mask, [0.0] * len(toks), [0] * len(toks), chunk, adv))
    return out


@torch.no_grad()
def set_rollout(samples: list[Sample], policy, chunk1_shift: float) -> None:
    for s in samples:
        ids = torch.tensor([s.token_ids])
        logits = policy(ids).logits[0, :-1].double()
        lp = torch.log_softmax(logits, -1)[torch.arange(len(s.token_ids) - 1), ids[0, 1:]]
        s.rollout_logprobs = [0.0] + [float(x) - (chunk1_shift if c == 1 else 0.0) if m else 0.0
                                      for x, m, c in zip(lp, s.loss_mask[1:], s.chunk_ids[1:])]


def ipa_grad(samples: list[Sample], **settings) -> tuple[torch.Tensor, dict]:
    cfg = TrainConfig(grad_clip=0.0, packing="flat",
                      loss=LossConfig(kind="ipa", settings=settings, aggregation="constant", constant_normalizer=16))
    t = Trainer(tiny_llama(layers=1, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=0), cfg)
    metrics = t.train_step(samples)
    return torch.cat([p.grad.flatten() for p in t.params]), metrics


def test_a_mismatched_chunk_gives_no_gradient():
    policy = tiny_llama(layers=1, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    shifted = two_chunk_samples(1)
    set_rollout(shifted, policy, chunk1_shift=2.0)  # pi_train / pi_rollout = e^2 > H on chunk 1 (positive advantages)
    g_masked, m = ipa_grad(shifted)
    assert m["loss/mismatch_frac"] == pytest.approx(20 / 36)
    # the same step on chunk 0 alone (chunk 1 out of the loss; the constant denominator keeps the scale)
    only0 = two_chunk_samples(1)
    set_rollout(only0, policy, chunk1_shift=0.0)
    for s in only0:
        s.loss_mask = [m if c == 0 else 0 for m, c in zip(s.loss_mask, s.chunk_ids)]
    g_only0, _ = ipa_grad(only0)
    torch.testing.assert_close(g_masked, g_only0, rtol=1e-5, atol=1e-8)
    # H above the mismatch, or a negative-side rule that does not apply to positive chunks: trained again
    g_loose, m_loose = ipa_grad(shifted, mask_threshold=10.0)
    assert m_loose["loss/mismatch_frac"] == 0 and (g_loose - g_masked).norm() > 1e-3 * g_masked.norm()
    for s in shifted:  # negative advantages: the sign rule masks them only when the trainer is BELOW the rollout
        s.advantages = [-a for a in s.advantages]
    _, m_neg = ipa_grad(shifted)
    _, m_both = ipa_grad(shifted, mask_sides="both")
    assert m_neg["loss/mismatch_frac"] == 0 and m_both["loss/mismatch_frac"] == pytest.approx(20 / 36)
