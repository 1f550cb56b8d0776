"""train/losses.py against float64 references written here as plain Python loops over samples and tokens."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arborl.config import ConfigError, LossConfig
from arborl.train.losses import aggregate, entropy_from_logits, kl_penalty, policy_loss, token_logprobs
from arborl.train.policy_losses import cispo_token_loss, ppo_clip_token_loss

F64 = torch.float64
SETTINGS = settings(max_examples=60, deadline=None)


def loss_cfg(kind: str = "ppo", settings: dict | None = None, **shared) -> LossConfig:
    """train.loss: the kind, its own settings, the shared terms."""
    return LossConfig(kind=kind, settings=settings or {}, **shared)


# ---------------------------------------------------------------- references (plain Python floats)


def ref_ppo(lp: float, old: float, a: float, el: float, eh: float, c: float | None) -> float:
    r = math.exp(lp - old)
    clipped = min(max(r, 1 - el), 1 + eh)
    loss = max(-a * r, -a * clipped)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss


def ref_cispo(lp: float, old: float, a: float, eh: float, el: float | None) -> float:
    w = min(math.exp(lp - old), 1 + eh)
    if el is not None:
        w = max(w, 1 - el)
    return -w * a * lp


def ref_kl(lp: float, ref: float, est: str) -> float:
    log_r = ref - lp
    return {"k1": -log_r, "k2": 0.5 * log_r * log_r, "k3": math.exp(log_r) - 1 - log_r}[est]


def ref_aggregate(vals, mask, mode, L=None, num_tokens=None, num_samples=None) -> float:
    B, T = len(vals), len(vals[0])
    total, tokens, samples, seq_sum = 0.0, 0.0, 0, 0.0
    for b in range(B):
        s, n = 0.0, 0.0
        for t in range(T):
            if mask[b][t] > 0:
                s += mask[b][t] * vals[b][t]
                n += mask[b][t]
        total += s
        tokens += n
        if n > 0:
            samples += 1
            seq_sum += s / n
    tokens = tokens if num_tokens is None else num_tokens
    samples = samples if num_samples is None else num_samples
    if mode == "token_mean":
        return total / tokens if tokens > 0 else 0.0
    if mode == "seq_mean":
        return seq_sum / samples if samples > 0 else 0.0
    denom = samples * (T if L is None else L)
    return total / denom if denom > 0 else 0.0


def to_lists(x: torch.Tensor):
    return x.double().tolist()


def batch(seed: int, B: int = 6, T: int = 9, per_sample_adv: bool = False, spread: float = 0.4):
    """Random log-probs / advantages with a zero-length sample (row 0) and a fully masked row (row 1)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.01
    old = logp + torch.randn(B, T, generator=g, dtype=F64) * spread
    adv = torch.randn(B if per_sample_adv else (B, T), generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    mask[0] = 0  # zero-length
    mask[1] = 0  # fully masked (a prompt-only row)
    mask[2, 0] = 0  # a masked prompt token inside a sample
    return logp, old, adv, mask


def expand_adv(adv: torch.Tensor, T: int):
    return adv[:, None].expand(-1, T) if adv.dim() == 1 else adv


# ---------------------------------------------------------------- PPO and CISPO vs the references

PPO_CLIPS = [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.5, 3.0), (0.0, 0.0, 1.5)]
AGGS = [("token_mean", None), ("seq_mean", None), ("constant", None), ("constant", 16)]


@pytest.mark.parametrize("el, eh, c", PPO_CLIPS)
@pytest.mark.parametrize("agg, L", AGGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_loss_matches_reference(el, eh, c, agg, L, seed):
    logp, old, adv, mask = batch(seed, per_sample_adv=seed == 1)
    B, T = logp.shape
    a = to_lists(expand_adv(adv, T))
    lp, od, m = to_lists(logp), to_lists(old), to_lists(mask)
    tok = [[ref_ppo(lp[b][t], od[b][t], a[b][t], el, eh, c) if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    expect = ref_aggregate(tok, m, agg, L)
    cfg = loss_cfg("ppo", dict(clip_low=el, clip_high=eh, dual_clip=c), aggregation=agg, constant_normalizer=L)
    loss, met = policy_loss(cfg, logp, old, adv, mask)
    assert loss.dtype == F64
    assert loss.item() == pytest.approx(expect, rel=1e-12, abs=1e-12)
    # clip fraction: tokens where the clipped branch is active (strict inequalities)
    n = hi = lo = du = 0
    ratios = []
    for b in range(B):
        for t in range(T):
            if m[b][t]:
                r = math.exp(lp[b][t] - od[b][t])
                ratios.append(r)
                n += 1
                hi += a[b][t] > 0 and r > 1 + eh
                lo += a[b][t] < 0 and r < 1 - el
                du += c is not None and a[b][t] < 0 and r > c
    assert met["loss/clip_frac_high"] == pytest.approx(hi / n)
    assert met["loss/clip_frac_low"] == pytest.approx(lo / n)
    assert met["loss/clip_frac_dual"] == pytest.approx(du / n)
    assert met["loss/clip_frac"] == pytest.approx((hi + lo + du) / n)
    assert met["loss/ratio_mean"] == pytest.approx(sum(ratios) / n)
    assert met["loss/ratio_max"] == pytest.approx(max(ratios))
    assert met["loss/approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / n)
    assert met["loss/tokens"] == n


@pytest.mark.parametrize("eh, el", [(0.28, None), (0.2, 0.2), (2.0, None), (0.0, 0.5)])
@pytest.mark.parametrize("agg, L", AGGS)
def test_cispo_loss_matches_reference(eh, el, agg, L):
    logp, old, adv, mask = batch(3, spread=0.6)
    B, T = logp.shape
    lp, od, a, m = to_lists(logp), to_lists(old), to_lists(adv), to_lists(mask)
    tok = [[ref_cispo(lp[b][t], od[b][t], a[b][t], eh, el) if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    cfg = loss_cfg("cispo", dict(eps_high=eh, eps_low=el), aggregation=agg, constant_normalizer=L)
    loss, met = policy_loss(cfg, logp, old, adv, mask)
    assert loss.item() == pytest.approx(ref_aggregate(tok, m, agg, L), rel=1e-12, abs=1e-12)
    n = sum(1 for b in range(B) for t in range(T) if m[b][t])
    hi = sum(1 for b in range(B) for t in range(T) if m[b][t] and math.exp(lp[b][t] - od[b][t]) > 1 + eh)
    assert met["loss/clip_frac_high"] == pytest.approx(hi / n)


def test_importance_weights_multiply_the_per_token_loss():
    logp, old, adv, mask = batch(4)
    B, T = logp.shape
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(9), dtype=F64) * 2
    w[3, 2] = 0.0  # a masked-out (MIS) token: weight 0 but still counted in the token denominator
    lp, od, a, m, wl = map(to_lists, (logp, old, adv, mask, w))
    for kind, ref in [("ppo", lambda b, t: ref_ppo(lp[b][t], od[b][t], a[b][t], 0.2, 0.28, None)),
                      ("cispo", lambda b, t: ref_cispo(lp[b][t], od[b][t], a[b][t], 0.28, None))]:
        tok = [[wl[b][t] * ref(b, t) if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
        loss, _ = policy_loss(loss_cfg(kind), logp, old, adv, mask, weights=w)
        assert loss.item() == pytest.approx(ref_aggregate(tok, m, "token_mean"), rel=1e-12)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_and_entropy_terms_match_reference(est):
    logp, old, adv, mask = batch(5)
    B, T = logp.shape
    g = torch.Generator().manual_seed(11)
    ref_lp = logp + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    ent = torch.rand(B, T, generator=g, dtype=F64) * 2
    lp, od, a, m, rl, en = map(to_lists, (logp, old, adv, mask, ref_lp, ent))
    pg = [[ref_ppo(lp[b][t], od[b][t], a[b][t], 0.2, 0.28, None) if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    kl = [[ref_kl(lp[b][t], rl[b][t], est) if m[b][t] else 0.0 for t in range(T)] for b in range(B)]
    for agg in ("token_mean", "seq_mean", "constant"):
        expect = ref_aggregate(pg, m, agg) + 0.05 * ref_aggregate(kl, m, agg) - 0.01 * ref_aggregate(en, m, agg)
        cfg = loss_cfg(kl_coef=0.05, kl_estimator=est, entropy_coef=0.01, aggregation=agg)
        loss, met = policy_loss(cfg, logp, old, adv, mask, ref_logprobs=ref_lp, entropy=ent)
        assert loss.item() == pytest.approx(expect, rel=1e-12)
    n = sum(1 for b in range(B) for t in range(T) if m[b][t])
    assert met["loss/kl"] == pytest.approx(sum(kl[b][t] for b in range(B) for t in range(T) if m[b][t]) / n)
    assert met["loss/entropy"] == pytest.approx(sum(en[b][t] for b in range(B) for t in range(T) if m[b][t]) / n)


def test_kl_estimators_per_token():
    g = torch.Generator().manual_seed(2)
    lp, ref = -torch.rand(4, 7, generator=g, dtype=F64) * 4, -torch.rand(4, 7, generator=g, dtype=F64) * 4
    for est in ("k1", "k2", "k3"):
        got = kl_penalty(lp, ref, est)
        for b in range(4):
            for t in range(7):
                assert got[b, t].item() == pytest.approx(ref_kl(lp[b, t].item(), ref[b, t].item(), est), rel=1e-12, abs=1e-15)
    assert bool((kl_penalty(lp, ref, "k3") >= 0).all())
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k4")


# ---------------------------------------------------------------- clip edges


@pytest.mark.parametrize("el, eh", [(0.2, 0.28), (0.1, 0.4)])
def test_ppo_clip_edges(el, eh):
    """Ratios exactly at 1 - eps_low / 1 + eps_high and 1e-6 inside / outside, both advantage signs."""
    d = 1e-6
    ratios = [1 - el - d, 1 - el, 1 - el + d, 1.0, 1 + eh - d, 1 + eh, 1 + eh + d]
    old = torch.full((2, len(ratios)), -1.5, dtype=F64)
    logp = (old + torch.log(torch.tensor(ratios, dtype=F64))).requires_grad_(True)
    adv = torch.tensor([[1.0] * len(ratios), [-1.0] * len(ratios)], dtype=F64)
    loss, clipped = ppo_clip_token_loss(logp, old, adv, clip_low=el, clip_high=eh)
    for b in range(2):
        for t in range(len(ratios)):
            assert loss[b, t].item() == pytest.approx(ref_ppo(logp[b, t].item(), -1.5, adv[b, t].item(), el, eh, None), abs=1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    r = torch.exp(logp.detach() - old)  # the ratios as computed (exact edges may round by an ulp)
    # A > 0 clips (zero gradient) strictly above 1 + eps_high; A < 0 strictly below 1 - eps_low
    assert clipped["high"][0].tolist() == [x > 1 + eh for x in r[0].tolist()]
    assert clipped["low"][1].tolist() == [x < 1 - el for x in r[1].tolist()]
    assert clipped["high"][0].tolist()[-1] and not any(clipped["high"][0].tolist()[:5])
    assert clipped["low"][1].tolist()[0] and not any(clipped["low"][1].tolist()[2:])
    assert grad[0, -1].item() == 0.0 and grad[1, 0].item() == 0.0
    for t in (2, 3, 4):  # strictly inside: d l / d logp = -A rho
        assert grad[0, t].item() == pytest.approx(-r[0, t].item(), rel=1e-9)
        assert grad[1, t].item() == pytest.approx(r[1, t].item(), rel=1e-9)
    # the non-binding side never clips: A > 0 below 1 - eps_low, A < 0 above 1 + eps_high keep -A rho
    assert grad[0, 0].item() == pytest.approx(-r[0, 0].item(), rel=1e-9)
    assert grad[1, -1].item() == pytest.approx(r[1, -1].item(), rel=1e-9)


def test_ppo_gradient_zero_on_clipped_side_and_dual_clip():
    g = torch.Generator().manual_seed(7)
    B, T, el, eh, c = 5, 40, 0.2, 0.28, 3.0
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    log_r = (torch.rand(B, T, generator=g, dtype=F64) * 3 - 1.5)  # ratios in [0.22, 4.5]
    logp = (old + log_r).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    loss, _ = ppo_clip_token_loss(logp, old, adv, clip_low=el, clip_high=eh, dual_clip=c)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    for b in range(B):
        for t in range(T):
            r, a = math.exp(log_r[b, t].item()), adv[b, t].item()
            if min(abs(r - (1 + eh)), abs(r - (1 - el)), abs(r - c)) < 1e-6:
                continue
            clipped = (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el) or (a < 0 and r > c)
            expect = 0.0 if clipped else -a * r  # d(-A rho)/d logp = -A rho
            assert grad[b, t].item() == pytest.approx(expect, rel=1e-10, abs=1e-14)


def test_cispo_weight_clip_edges_and_no_lower_bound():
    d = 1e-6
    eh = 0.28
    ratios = [1e-3, 0.5, 1 + eh - d, 1 + eh, 1 + eh + d, 10.0]
    old = torch.full((1, len(ratios)), -2.0, dtype=F64)
    logp = (old + torch.log(torch.tensor(ratios, dtype=F64))).requires_grad_(True)
    adv = torch.ones_like(old)
    loss, clipped = cispo_token_loss(logp, old, adv, eps_high=eh)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    expect_w = [1e-3, 0.5, 1 + eh - d, 1 + eh, 1 + eh, 1 + eh]  # no lower bound: 1e-3 stays 1e-3
    for t, w in enumerate(expect_w):
        assert grad[0, t].item() == pytest.approx(-w, rel=1e-9)  # every token keeps a gradient
    assert clipped["high"][0].tolist() == [False, False, False, False, True, True]
    assert not clipped["low"].any()


def test_cispo_gradient_is_stopgrad_weight_times_advantage_times_grad_logprob():
    """grad_theta L = -1/N sum_t sg(clip(rho_t)) A_t grad_theta log pi_theta(o_t), checked against per-token autograd."""
    g = torch.Generator().manual_seed(4)
    B, T, V, H = 3, 5, 7, 4
    x = torch.randn(B, T, H, generator=g, dtype=F64)
    theta = (torch.randn(H, V, generator=g, dtype=F64) * 0.5).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=F64)
    mask[1, 3:] = 0
    mask[2] = 0
    logp = token_logprobs(x @ theta, targets)
    old = (logp + torch.randn(B, T, generator=g, dtype=F64) * 0.5).detach()
    adv = torch.randn(B, T, generator=g, dtype=F64)
    loss, _ = policy_loss(loss_cfg("cispo", {"eps_high": 0.2}), logp, old, adv, mask)
    (got,) = torch.autograd.grad(loss, theta, retain_graph=True)
    expect = torch.zeros_like(theta)
    n = int(mask.sum())
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                (glp,) = torch.autograd.grad(logp[b, t], theta, retain_graph=True)
                w = min(math.exp(logp[b, t].item() - old[b, t].item()), 1.2)
                expect += -w * adv[b, t].item() * glp / n
    torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- degenerate batches, no NaN


@pytest.mark.parametrize("kind", ["ppo", "cispo"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "constant"])
def test_fully_masked_batch_and_garbage_off_mask(kind, agg):
    B, T = 3, 4
    logp = torch.full((B, T), -1.0, dtype=F64, requires_grad=True)
    garbage = torch.tensor([[math.nan, math.inf, -math.inf, 1e30]] * B, dtype=F64)
    # nothing on the mask: loss 0, gradient 0
    cfg = loss_cfg(kind, aggregation=agg, kl_coef=0.1, entropy_coef=0.1)
    loss, met = policy_loss(cfg, logp, garbage, garbage, torch.zeros(B, T), ref_logprobs=garbage, entropy=garbage)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))
    assert all(math.isfinite(v) for v in met.values())
    # garbage only off the mask does not leak into the loss or the gradient
    mask = torch.zeros(B, T)
    mask[:, 0] = 1
    logp2 = torch.tensor([[-1.0, math.nan, -math.inf, 5.0]] * B, dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.2, math.nan, math.inf, -1e30]] * B, dtype=F64)
    adv = torch.tensor([[0.5, math.nan, math.inf, 1.0]] * B, dtype=F64)
    weights = torch.tensor([[0.7, math.nan, math.inf, 1e30]] * B, dtype=F64)
    loss, met = policy_loss(cfg, logp2, old, adv, mask, weights=weights, ref_logprobs=old, entropy=adv)
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(logp2.grad).all())
    assert logp2.grad[:, 1:].abs().sum().item() == 0.0


def test_policy_loss_takes_the_config_section_and_refuses_what_it_cannot_compute():
    logp, old, adv, mask = batch(8)
    loss, met = policy_loss(LossConfig(kind="cispo", aggregation="seq_mean"), logp, old, adv, mask)
    tok, _ = cispo_token_loss(logp, old, adv)
    assert loss.item() == aggregate(tok, mask, "seq_mean").item()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(loss_cfg(kl_coef=0.1), logp, old, adv, mask)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(loss_cfg(entropy_coef=0.1), logp, old, adv, mask)
    with pytest.raises(ConfigError, match="train.loss.kind: unknown policy loss .reinforce."):
        policy_loss(loss_cfg("reinforce"), logp, old, adv, mask)
    with pytest.raises(ConfigError, match="train.loss.settings.dual_clip: Input should be greater than 1"):
        policy_loss(loss_cfg("ppo", {"dual_clip": 0.5}), logp, old, adv, mask)


# ---------------------------------------------------------------- from logits


def test_token_logprobs_and_entropy_from_logits():
    g = torch.Generator().manual_seed(5)
    B, T, V = 2, 3, 6
    logits = torch.randn(B, T, V, generator=g, dtype=F64)
    logits[0, 1, 2] = -math.inf  # a banned token
    logits.requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 1] = 0
    lp = token_logprobs(logits, targets)
    ent = entropy_from_logits(logits)
    z = logits.detach().tolist()
    for b in range(B):
        for t in range(T):
            mx = max(z[b][t])
            s = sum(math.exp(v - mx) for v in z[b][t])
            logz = mx + math.log(s)
            assert lp[b, t].item() == pytest.approx(z[b][t][targets[b, t]] - logz, rel=1e-12)
            h = -sum(math.exp(v - logz) * (v - logz) for v in z[b][t] if v != -math.inf)
            assert ent[b, t].item() == pytest.approx(h, rel=1e-12)
    (ent.sum() + lp.sum()).backward()
    assert bool(torch.isfinite(logits.grad).all())
    # bf16 logits are upcast, not computed in bf16
    assert entropy_from_logits(logits.detach().bfloat16()).dtype == torch.float32
    # logits route through policy_loss for the entropy bonus
    mask = torch.ones(B, T)
    _, met = policy_loss(loss_cfg(entropy_coef=0.1), lp.detach(), lp.detach(), torch.zeros(B), mask, logits=logits.detach())
    assert met["loss/entropy"] == pytest.approx(ent.mean().item())


# ---------------------------------------------------------------- aggregation properties (hypothesis)


@st.composite
def masked_values(draw):
    B = draw(st.integers(1, 6))
    T = draw(st.integers(1, 7))
    vals = draw(st.lists(st.lists(st.floats(-10, 10), min_size=T, max_size=T), min_size=B, max_size=B))
    mask = draw(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=T, max_size=T), min_size=B, max_size=B))
    return vals, mask


@SETTINGS
@given(masked_values(), st.sampled_from(["token_mean", "seq_mean", "constant"]), st.sampled_from([None, 5]))
def test_aggregate_matches_reference(vm, mode, L):
    vals, mask = vm
    got = aggregate(torch.tensor(vals, dtype=F64), torch.tensor(mask, dtype=F64), mode, constant_normalizer=L)
    assert got.item() == pytest.approx(ref_aggregate(vals, mask, mode, L), rel=1e-12, abs=1e-12)


@SETTINGS
@given(masked_values(), st.sampled_from(["token_mean", "seq_mean", "constant"]), st.data())
def test_aggregate_micro_batches_sum_to_the_batch(vm, mode, data):
    vals, mask = vm
    v, m = torch.tensor(vals, dtype=F64), torch.tensor(mask, dtype=F64)
    full = aggregate(v, m, mode, constant_normalizer=4)
    cut = data.draw(st.integers(0, v.shape[0]))
    totals = dict(num_tokens=m.sum().item(), num_samples=int((m.sum(-1) > 0).sum()))
    parts = [aggregate(v[s], m[s], mode, constant_normalizer=4, **totals) for s in (slice(0, cut), slice(cut, None))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)


@SETTINGS
@given(masked_values(), st.floats(-5, 5))
def test_aggregate_of_a_constant(vm, c):
    _, mask = vm
    m = torch.tensor(mask, dtype=F64)
    v = torch.full_like(m, c)
    nonempty = bool(m.sum() > 0)
    for mode in ("token_mean", "seq_mean"):
        assert aggregate(v, m, mode).item() == pytest.approx(c if nonempty else 0.0, abs=1e-12)
    # constant mode: c * tokens / (samples * L)
    samples = int((m.sum(-1) > 0).sum())
    expect = c * m.sum().item() / (samples * 3) if samples else 0.0
    assert aggregate(v, m, "constant", constant_normalizer=3).item() == pytest.approx(expect, abs=1e-12)


def test_aggregate_float_mask_and_bool_mask():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=F64)
    fm = torch.tensor([[1.0, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    assert aggregate(v, fm, "token_mean").item() == pytest.approx((1 + 1 + 4) / 2.5)
    bm = fm > 0
    assert aggregate(v, bm, "seq_mean").item() == pytest.approx((1.5 + 4) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(v, bm, "sum")


def test_one_importance_ratio_and_one_clamp_for_losses_and_corrections():
    """train/ratio.py is the only place that defines the ratio and its clamp (losses, policy losses and
    corrections all import it)."""
    train = Path(__file__).resolve().parents[1] / "src" / "arborl" / "train"
    defining = sorted(f.name for f in train.glob("*.py")
                      if re.search(r"^(LOG_RATIO_CLAMP\s*=|def _?ratio\(|def importance_ratio\()", f.read_text(), re.M))
    assert defining == ["ratio.py"]
    for name in ("losses.py", "policy_losses.py", "corrections.py"):
        assert "from arborl.train.ratio import" in (train / name).read_text()
