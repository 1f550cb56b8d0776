"""train/corrections.py against a float64 reference written here as plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from arborl.config import CorrectionConfig
from arborl.train.corrections import rollout_correction

F64 = torch.float64


# ---------------------------------------------------------------- the reference


def ref_correction(train, roll, mask, chunks, *, mode, level, C, low, high, veto):
    """Weights [B][T] and metrics by loops; units' log-ratios clamped to [-20, 20] like the module."""
    B, T = len(train), len(train[0])
    W = [[0.0] * T for _ in range(B)]
    lr = [[train[b][t] - roll[b][t] if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    toks = [(b, t) for b in range(B) for t in range(T) if mask[b][t]]
    vetoed = 0
    truncated = 0
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        unit = {}
        for t in idx:
            if level == "token":
                unit[t] = lr[b][t]
            elif level == "sequence":
                unit[t] = sum(lr[b][s] for s in idx)
            elif level == "geometric":
                unit[t] = sum(lr[b][s] for s in idx) / len(idx)
            else:
                same = [s for s in idx if chunks[b][s] == chunks[b][t]]
                unit[t] = sum(lr[b][s] for s in same) / len(same)
        is_vetoed = veto is not None and any(math.exp(lr[b][t]) < veto for t in idx)
        vetoed += is_vetoed
        for t in idx:
            rho = math.exp(min(max(unit[t], -20.0), 20.0))
            if mode == "none":
                w = 1.0
            elif mode == "tis":
                w = min(rho, C)
                truncated += rho > C
            else:
                w = rho if low <= rho <= high else 0.0
            W[b][t] = 0.0 if is_vetoed else w
    n = len(toks)
    ratios = [math.exp(lr[b][t]) for b, t in toks]
    nonempty = sum(1 for b in range(B) if any(mask[b]))
    metrics = {
        "mismatch/k3_kl": sum(r - 1 - math.log(r) for r in ratios) / n,
        "mismatch/logp_abs_diff_mean": sum(abs(lr[b][t]) for b, t in toks) / n,
        "mismatch/logp_abs_diff_max": max(abs(lr[b][t]) for b, t in toks),
        "mismatch/ratio_mean": sum(ratios) / n,
        "mismatch/ratio_min": min(ratios),
        "mismatch/ratio_max": max(ratios),
        "mismatch/masked_frac": sum(1 for b, t in toks if W[b][t] == 0.0) / n,
        "mismatch/truncated_frac": truncated / n,
        "mismatch/veto_frac": vetoed / nonempty,
        "mismatch/weight_mean": sum(W[b][t] for b, t in toks) / n,
        "mismatch/tokens": float(n),
    }
    return W, metrics


def batch(seed: int, B: int = 6, T: int = 10, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(B, T, generator=g, dtype=F64) * 4
    train = roll + torch.randn(B, T, generator=g, dtype=F64) * spread
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask[0] = False  # zero-length sample
    mask[1, :] = False  # fully masked row
    mask[2, :2] = False  # prompt tokens before the completion
    chunks = torch.cumsum(torch.rand(B, T, generator=g) < 0.3, dim=1)  # env interactions split chunks
    return train, roll, mask, chunks


def check(seed, **kw):
    train, roll, mask, chunks = batch(seed, spread=kw.pop("spread", 0.5))
    W, expect = ref_correction(train.tolist(), roll.tolist(), mask.tolist(), chunks.tolist(), **kw)
    cfg = dict(mode=kw["mode"], level=kw["level"], tis_cap=kw["C"], mask_low=kw["low"], mask_high=kw["high"], veto=kw["veto"])
    weights, metrics = rollout_correction(train, roll, mask, chunk_ids=chunks, **cfg)
    torch.testing.assert_close(weights, torch.tensor(W, dtype=F64), rtol=1e-12, atol=1e-14)
    assert set(metrics) == set(expect)
    for k, v in expect.items():
        assert metrics[k] == pytest.approx(v, rel=1e-10, abs=1e-14), k
    return weights, metrics


# ---------------------------------------------------------------- modes x levels against the reference


@pytest.mark.parametrize("level", ["token", "sequence", "geometric", "chunk"])
@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
@pytest.mark.parametrize("veto", [None, 0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference(mode, level, veto, seed):
    check(seed, mode=mode, level=level, C=1.5, low=0.6, high=1.6, veto=veto)


def test_icepop_is_token_level_mis():
    w, _ = check(2, mode="icepop", level="token", C=2.0, low=0.5, high=5.0, veto=None, spread=1.5)
    w2, _ = rollout_correction(*batch(2, spread=1.5)[:3], mode="mis", level="token", mask_low=0.5, mask_high=5.0)
    assert torch.equal(w, w2)
    assert bool((w == 0).any()), "spread 1.5 should push some tokens outside [0.5, 5]"
    with pytest.raises(ValueError, match="token-level"):
        rollout_correction(*batch(2)[:3], mode="icepop", level="sequence")


def test_sequence_level_extreme_ratios_stay_finite():
    # a long sample with a large total log-ratio: product far beyond float range, clamped at e^20
    train, roll, mask, chunks = batch(3, spread=3.0, T=10)
    for mode in ("tis", "mis"):
        check(3, mode=mode, level="sequence", C=2.0, low=0.5, high=2.0, veto=None, spread=3.0)
        w, met = rollout_correction(train, roll, mask, mode=mode, level="sequence", tis_cap=2.0, mask_low=0.5, mask_high=2.0)
        assert bool(torch.isfinite(w).all()) and all(math.isfinite(v) for v in met.values())
    # 8 tokens with log-ratio +5 (product e^40) and 8 with -5 (e^-40)
    roll = torch.full((2, 8), -3.0, dtype=F64)
    train = roll + torch.tensor([[5.0], [-5.0]], dtype=F64)
    mask = torch.ones(2, 8)
    w, met = rollout_correction(train, roll, mask, mode="tis", level="sequence", tis_cap=2.0)
    assert w[0].tolist() == [2.0] * 8 and w[1].tolist() == pytest.approx([math.exp(-20)] * 8)
    w, met = rollout_correction(train, roll, mask, mode="mis", level="sequence", mask_low=0.5, mask_high=2.0)
    assert w.abs().sum().item() == 0.0 and met["mismatch/masked_frac"] == 1.0
    w, met = rollout_correction(train, roll, mask, mode="tis", level="geometric", tis_cap=1e9)
    assert w[0].tolist() == pytest.approx([math.exp(5)] * 8) and w[1].tolist() == pytest.approx([math.exp(-5)] * 8)
    assert met["mismatch/ratio_max"] == pytest.approx(math.exp(5))


# ---------------------------------------------------------------- edges


def tokens_with_ratios(ratios):
    roll = torch.full((1, len(ratios)), -2.0, dtype=F64)
    train = roll + torch.log(torch.tensor(ratios, dtype=F64))
    return train, roll, torch.ones(1, len(ratios), dtype=torch.bool)


def test_mask_bounds_are_inclusive_and_tis_truncates_at_C():
    d = 1e-9
    ratios = [0.5 - d, 0.5, 0.5 + d, 1.0, 2.0 - d, 2.0, 2.0 + d]
    train, roll, mask = tokens_with_ratios(ratios)
    rho = torch.exp(train - roll)[0].tolist()  # as computed (exact bounds may round by an ulp)
    w, met = rollout_correction(train, roll, mask, mode="mis", mask_low=0.5, mask_high=2.0)
    assert w[0].tolist() == [r if 0.5 <= r <= 2.0 else 0.0 for r in rho]
    assert w[0, 0].item() == 0.0 and w[0, -1].item() == 0.0 and all(x > 0 for x in w[0, 2:5].tolist())
    assert met["mismatch/masked_frac"] == pytest.approx(sum(1 for x in w[0].tolist() if x == 0) / len(ratios))
    w, met = rollout_correction(train, roll, mask, mode="tis", tis_cap=2.0)
    assert w[0].tolist() == [min(r, 2.0) for r in rho]
    assert met["mismatch/truncated_frac"] == pytest.approx(sum(r > 2.0 for r in rho) / len(ratios))
    assert met["mismatch/masked_frac"] == 0.0


def test_veto_zeroes_the_whole_sample():
    train, roll, _ = tokens_with_ratios([1.0, 1.1, 0.9, 1e-5, 1.0])
    train = torch.cat([train, roll + 0.01])  # second sample: no bad token
    roll = torch.cat([roll, roll])
    mask = torch.ones(2, 5, dtype=torch.bool)
    for mode in ("none", "tis", "mis"):
        w, met = rollout_correction(train, roll, mask, mode=mode, veto=1e-4)
        assert w[0].tolist() == [0.0] * 5 and bool((w[1] > 0).all())
        assert met["mismatch/veto_frac"] == 0.5 and met["mismatch/masked_frac"] == 0.5
    # the bad token off the mask does not veto
    mask[0, 3] = False
    w, met = rollout_correction(train, roll, mask, veto=1e-4)
    assert met["mismatch/veto_frac"] == 0.0 and bool((w[0][mask[0]] == 1).all())


def test_no_loss_tokens_and_garbage_off_mask():
    B, T = 3, 4
    train = torch.tensor([[math.nan, math.inf, -math.inf, 0.0]] * B, dtype=F64)
    roll = torch.tensor([[0.0, -math.inf, math.inf, 1e30]] * B, dtype=F64)
    for mode, level in [("none", "token"), ("tis", "sequence"), ("mis", "geometric"), ("mis", "chunk"), ("icepop", "token")]:
        w, met = rollout_correction(train, roll, torch.zeros(B, T), mode=mode, level=level, veto=1e-3,
                                    chunk_ids=torch.zeros(B, T, dtype=torch.long))
        assert torch.equal(w, torch.zeros(B, T, dtype=F64))
        assert all(v == 0.0 for v in met.values())
    # one clean loss token per row next to garbage
    train[:, 3], roll[:, 3] = -1.0, -1.1
    mask = torch.zeros(B, T)
    mask[:, 3] = 1
    for level in ("token", "sequence", "geometric", "chunk"):
        w, met = rollout_correction(train, roll, mask, mode="tis", level=level, veto=1e-3, chunk_ids=torch.full((B, T), 7))
        assert w[:, 3].tolist() == pytest.approx([math.exp(0.1)] * B) and w[:, :3].abs().sum().item() == 0.0
        assert all(math.isfinite(v) for v in met.values())
        assert met["mismatch/k3_kl"] == pytest.approx(math.exp(0.1) - 1 - 0.1)


def test_weights_are_detached_and_follow_the_input_dtype():
    train, roll, mask, chunks = batch(5)
    train = train.float().requires_grad_(True)
    w, _ = rollout_correction(train, roll.float(), mask, mode="tis")
    assert not w.requires_grad and w.dtype == torch.float32


def test_bad_arguments_and_config_fields_are_the_keywords():
    train, roll, mask, chunks = batch(6)
    cfg = CorrectionConfig(mode="mis", level="chunk", mask_low=0.4, mask_high=3.0, veto=1e-4)
    w1, m1 = rollout_correction(train, roll, mask, chunk_ids=chunks, **cfg.model_dump())
    w2, m2 = rollout_correction(train, roll, mask, chunk_ids=chunks, mode="mis", level="chunk", mask_low=0.4, mask_high=3.0, veto=1e-4)
    assert torch.equal(w1, w2) and m1 == m2
    with pytest.raises(ValidationError, match="token-level"):
        CorrectionConfig(mode="icepop", level="geometric")
    with pytest.raises(ValidationError, match="mask_low"):
        CorrectionConfig(mask_low=3.0, mask_high=2.0)
    with pytest.raises(ValueError, match="chunk_ids"):
        rollout_correction(train, roll, mask, level="chunk")
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(train, roll, mask, mode="clip")
    with pytest.raises(ValueError, match="mask_low"):
        rollout_correction(train, roll, mask, mode="mis", mask_low=2.0, mask_high=1.0)
