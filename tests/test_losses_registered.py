"""GSPO, GMPO, SAPO, Clip-Cov, KL-Cov and IPA (train/policy_losses.py) against float64 references written
here: the papers' sequence / chunk-level objectives as plain per-sample loops in torch float64 (so their
gradients come from autograd on a different formula), one test per loss setting that it changes the
gradient of its loss, and that a setting is refused under a kind it does not belong to."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from arborl.config import ConfigError, LossConfig
from arborl.train.losses import policy_loss
from arborl.train.policy_losses import POLICY_LOSSES

F64 = torch.float64


def loss_cfg(kind: str, settings: dict | None = None, **shared) -> LossConfig:
    return LossConfig(kind=kind, settings=settings or {}, **shared)


def data(seed: int, B: int = 5, T: int = 10, spread: float = 0.3, per_sample_adv: bool = True):
    """logp (leaf, grad), old, adv, mask (row 0 fully masked; leading prompt tokens masked), chunk ids
    (two chunks per sample), rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=F64) * 4 - 0.2).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=g, dtype=F64) * spread
    if per_sample_adv:
        adv = (torch.randn(B, 1, generator=g, dtype=F64) * 1.5).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g, dtype=F64) * 1.5
    starts = torch.randint(0, 3, (B,), generator=g)
    ends = torch.randint(T - 3, T + 1, (B,), generator=g)
    pos = torch.arange(T)[None, :]
    mask = ((pos >= starts[:, None]) & (pos < ends[:, None])).to(F64)
    mask[0] = 0
    chunks = (pos >= (starts[:, None] + ends[:, None]) // 2).long().expand(B, T).clone()
    rollout = logp.detach() + torch.randn(B, T, generator=g, dtype=F64) * 0.6
    return logp, old, adv, mask, chunks, rollout


def grad_of(loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, logp)
    return g


def rows(mask: torch.Tensor):
    for b in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        if idx:
            yield b, idx


def seq_mean(per_sample: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(per_sample).mean()


# ---------------------------------------------------------------- references


def ref_gspo(logp, old, adv, mask, el, eh):
    """GSPO's J (seq_mean): per sample s_i = exp(mean_t (logp - old)); min(s A, clip(s) A)."""
    out = []
    for b, idx in rows(mask):
        s = torch.exp(sum(logp[b, t] - old[b, t] for t in idx) / len(idx))
        a = adv[b, idx[0]]
        out.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - el, 1 + eh)))
    return seq_mean(out)


def ref_gmpo(logp, old, adv, mask, el, eh):
    """GMPO's J (seq_mean): -A_i (prod_t |min(rho A, clip(rho, e^-el, e^eh) A)|)^(1/n) sgn(A), as a product."""
    out = []
    for b, idx in rows(mask):
        a = adv[b, idx[0]]
        prod = torch.ones((), dtype=F64)
        for t in idx:
            rho = torch.exp(logp[b, t] - old[b, t])
            prod = prod * torch.abs(torch.minimum(rho * a, torch.clamp(rho, math.exp(-el), math.exp(eh)) * a))
        out.append(-(prod ** (1.0 / len(idx))) * torch.sign(a))
    return seq_mean(out)


def ref_sapo(logp, old, adv, mask, tp, tn):
    out = []
    for b, idx in rows(mask):
        terms = []
        for t in idx:
            tau = tp if adv[b, t] > 0 else tn
            rho = torch.exp(logp[b, t] - old[b, t])
            terms.append(-torch.sigmoid(tau * (rho - 1)) * 4 / tau * adv[b, t])
        out.append(torch.stack(terms).mean())
    return seq_mean(out)


def ref_cov(logp, adv, mask):
    cells = [(b, t) for b, idx in rows(mask) for t in idx]
    ma = sum(float(adv[b, t]) for b, t in cells) / len(cells)
    ml = sum(float(logp[b, t].detach()) for b, t in cells) / len(cells)
    return {(b, t): (float(adv[b, t]) - ma) * (float(logp[b, t].detach()) - ml) for b, t in cells}, cells


def ref_clip_cov(logp, old, adv, mask, el, eh, frac, lb, ub):
    """token_mean; the k = max(1, floor(frac N)) highest-covariance candidates in (lb, ub) are detached."""
    cov, cells = ref_cov(logp, adv, mask)
    losses, clipped = {}, set()
    for b, t in cells:
        rho = torch.exp(logp[b, t] - old[b, t])
        u, c = -adv[b, t] * rho, -adv[b, t] * torch.clamp(rho, 1 - el, 1 + eh)
        losses[b, t] = torch.maximum(u, c)
        if c.item() > u.item():
            clipped.add((b, t))
    cands = sorted((x for x in cells if lb < cov[x] < ub and x not in clipped), key=lambda x: -cov[x])
    picked = set(cands[: max(1, int(frac * len(cells)))])
    total = sum(losses[x].detach() if x in picked else losses[x] for x in cells)
    return total / len(cells), picked


def ref_kl_cov(logp, old, adv, mask, frac, coef):
    cov, cells = ref_cov(logp, adv, mask)
    picked = set(sorted(cells, key=lambda x: -cov[x])[: max(1, int(frac * len(cells)))])
    total = 0.0
    for b, t in cells:
        d = logp[b, t] - old[b, t]
        total = total - adv[b, t] * torch.exp(d) + (coef * torch.abs(d) if (b, t) in picked else 0.0)
    return total / len(cells), picked


def ref_ipa(logp, old, adv, mask, chunks, rollout, el, eh, H, sides):
    """token_mean; per chunk rho_c = (prod_t pi / pi_old)^(1/|c|) and its mismatch (prod_t pi / pi_rollout)^(1/|c|)."""
    n = sum(len(idx) for _, idx in rows(mask))
    total, masked = 0.0, set()
    for b, idx in rows(mask):
        for c in sorted({int(chunks[b, t]) for t in idx}):
            ts = [t for t in idx if int(chunks[b, t]) == c]
            rho = torch.exp(sum(logp[b, t] - old[b, t] for t in ts) / len(ts))
            mu = math.exp(sum(float(logp[b, t].detach()) - float(rollout[b, t]) for t in ts) / len(ts))
            for t in ts:
                a = adv[b, t]
                drop = (a > 0 and mu > H) or (a < 0 and mu < 1 / H) if sides == "sign" else (mu > H or mu < 1 / H)
                if drop:
                    masked.add((b, t))
                    continue
                total = total + torch.maximum(-a * rho, -a * torch.clamp(rho, 1 - el, 1 + eh))
    return total / n, masked


# ---------------------------------------------------------------- value and gradient vs the references


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("el, eh", [(3e-4, 4e-4), (0.05, 0.1), (0.5, 2.0)])
def test_gspo_matches_sequence_level_reference(seed, el, eh):
    logp, old, adv, mask, *_ = data(seed, spread=0.1)
    loss, met = policy_loss(loss_cfg("gspo", dict(clip_low=el, clip_high=eh), aggregation="seq_mean"),
                            logp, old, adv, mask)
    ref = ref_gspo(logp, old, adv, mask, el, eh)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp), rtol=1e-10, atol=1e-13)
    # the clip decision is per sequence: a clipped sample clips all its tokens
    lp = logp.detach()
    s = {b: math.exp(float(sum(lp[b, t] - old[b, t] for t in idx)) / len(idx)) for b, idx in rows(mask)}
    clipped = sum(len(idx) for b, idx in rows(mask)
                  if (adv[b, 0] > 0 and s[b] > 1 + eh) or (adv[b, 0] < 0 and s[b] < 1 - el))
    assert met["loss/clip_frac"] == pytest.approx(clipped / mask.sum().item())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("el, eh", [(0.4, 0.4), (0.05, 0.2), (1.0, 0.01)])
def test_gmpo_matches_geometric_mean_reference(seed, el, eh):
    logp, old, adv, mask, *_ = data(seed, spread=0.4)
    loss, met = policy_loss(loss_cfg("gmpo", dict(clip_low=el, clip_high=eh), aggregation="seq_mean"),
                            logp, old, adv, mask)
    ref = ref_gmpo(logp, old, adv, mask, el, eh)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-11, abs=1e-14)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tp, tn", [(1.0, 1.05), (0.3, 4.0)])
def test_sapo_matches_reference(seed, tp, tn):
    logp, old, adv, mask, *_ = data(seed, spread=0.6, per_sample_adv=False)
    loss, met = policy_loss(loss_cfg("sapo", dict(tau_pos=tp, tau_neg=tn), aggregation="seq_mean"),
                            logp, old, adv, mask)
    ref = ref_sapo(logp, old, adv, mask, tp, tn)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp), rtol=1e-10, atol=1e-13)
    assert met["loss/clip_frac"] == 0.0  # a soft gate, no hard clip


def cov_data(seed: int):
    """Advantages and log-probs spread so that token covariances reach (1, 5)."""
    logp, old, adv, mask, *_ = data(seed, B=6, T=12, spread=0.3, per_sample_adv=False)
    return logp, old, adv * 1.5, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("frac, lb, ub", [(2e-4, 1.0, 5.0), (0.1, 1.0, 5.0), (0.3, -1.0, 2.0)])
def test_clip_cov_matches_reference(seed, frac, lb, ub):
    logp, old, adv, mask = cov_data(seed)
    loss, met = policy_loss(loss_cfg("clip_cov", dict(frac=frac, lb=lb, ub=ub)), logp, old, adv, mask)
    ref, picked = ref_clip_cov(logp, old, adv, mask, 0.2, 0.28, frac, lb, ub)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp), rtol=1e-10, atol=1e-13)
    assert met["loss/cov_frac"] == pytest.approx(len(picked) / mask.sum().item())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("frac, coef", [(2e-4, 1.0), (0.2, 0.5), (1.0, 3.0)])
def test_kl_cov_matches_reference(seed, frac, coef):
    logp, old, adv, mask = cov_data(seed)
    loss, met = policy_loss(loss_cfg("kl_cov", dict(frac=frac, coef=coef)), logp, old, adv, mask)
    ref, picked = ref_kl_cov(logp, old, adv, mask, frac, coef)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp), rtol=1e-10, atol=1e-13)
    assert met["loss/cov_frac"] == pytest.approx(len(picked) / mask.sum().item())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("el, eh, H, sides",
                         [(0.2, 0.28, 2.0, "sign"), (0.05, 0.05, 1.2, "sign"), (0.2, 0.28, 1.2, "both")])
def test_ipa_matches_chunk_level_reference(seed, el, eh, H, sides):
    logp, old, adv, mask, chunks, rollout = data(seed, spread=0.3, per_sample_adv=False)
    # chunk advantages: one value per (sample, chunk), as chunk_returns gives
    adv = torch.where(chunks == 0, adv[:, :1], adv[:, -1:])
    rollout = logp.detach() + (rollout - logp.detach()) * 2  # chunk mismatches on both sides of 1
    cfg = loss_cfg("ipa", dict(clip_low=el, clip_high=eh, mask_threshold=H, mask_sides=sides))
    loss, met = policy_loss(cfg, logp, old, adv, mask, chunk_ids=chunks, rollout_logprobs=rollout)
    ref, masked = ref_ipa(logp, old, adv, mask, chunks, rollout, el, eh, H, sides)
    assert loss.item() == pytest.approx(float(ref.detach()), rel=1e-12)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp), rtol=1e-10, atol=1e-13)
    assert met["loss/mismatch_frac"] == pytest.approx(len(masked) / mask.sum().item())
    if H == 1.2:
        assert masked  # the case is not vacuous


def test_ipa_needs_chunks_and_rollout_logprobs():
    logp, old, adv, mask, chunks, rollout = data(0)
    with pytest.raises(ValueError, match="chunk_ids and rollout_logprobs"):
        policy_loss(loss_cfg("ipa"), logp, old, adv, mask)


# ---------------------------------------------------------------- on-policy: ratio 1 gives the PPO gradient


@pytest.mark.parametrize("kind", ["cispo", "gspo", "gmpo", "sapo", "kl_cov"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_on_policy_every_clipping_kind_gives_the_policy_gradient(kind, agg):
    logp, _, adv, mask, *_ = data(4, per_sample_adv=False)
    old = logp.detach()
    want = grad_of(policy_loss(loss_cfg("ppo", aggregation=agg), logp, old, adv, mask)[0], logp)
    got = grad_of(policy_loss(loss_cfg(kind, aggregation=agg), logp, old, adv, mask)[0], logp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- every setting changes its loss; settings are per kind

# (kind, setting, another value, inert at ratio 1)
SETTINGS = [
    ("ppo", "clip_low", 0.02, True),
    ("ppo", "clip_high", 0.02, True),
    ("ppo", "dual_clip", 1.05, True),
    ("cispo", "eps_high", 0.02, True),
    ("cispo", "eps_low", 0.02, True),
    ("gspo", "clip_low", 0.3, True),
    ("gspo", "clip_high", 0.3, True),
    ("gmpo", "clip_low", 0.02, True),
    ("gmpo", "clip_high", 0.02, True),
    ("sapo", "tau_pos", 5.0, True),
    ("sapo", "tau_neg", 5.0, True),
    ("clip_cov", "clip_low", 0.02, True),
    ("clip_cov", "clip_high", 0.02, True),
    ("clip_cov", "frac", 0.3, False),
    ("clip_cov", "lb", 4.9, False),
    ("clip_cov", "ub", 1.2, False),
    ("kl_cov", "frac", 0.3, True),
    ("kl_cov", "coef", 4.0, True),
    ("ipa", "clip_low", 0.02, True),
    ("ipa", "clip_high", 0.02, True),
    ("ipa", "mask_threshold", 1.05, False),
    ("ipa", "mask_sides", "both", False),
]


def setting_grad(kind: str, settings: dict, on_policy: bool = False) -> torch.Tensor:
    logp, old, adv, mask, chunks, rollout = data(7, B=8, T=12, spread=0.5, per_sample_adv=False)
    adv = adv * 1.5
    rollout = logp.detach() + (rollout - logp.detach()) * 2.5  # chunk mismatches beyond H = 2 on both sides
    if on_policy:
        old = logp.detach()
    loss, _ = policy_loss(loss_cfg(kind, settings), logp, old, adv, mask, chunk_ids=chunks, rollout_logprobs=rollout)
    return grad_of(loss, logp)


def test_the_table_lists_every_setting_of_every_registered_loss():
    listed = {(kind, name) for kind, name, *_ in SETTINGS}
    declared = set()
    for kind in POLICY_LOSSES.names():
        model = getattr(POLICY_LOSSES.get(kind), "Settings", None)
        declared |= {(kind, name) for name in (model.model_fields if model is not None else {})}
    assert listed == declared


@pytest.mark.parametrize("kind, name, value, inert", SETTINGS)
def test_each_setting_changes_its_gradient_and_is_refused_under_another_kind(kind, name, value, inert):
    changed = not torch.allclose(setting_grad(kind, {name: value}), setting_grad(kind, {}))
    assert changed, f"{name} is inert for {kind}"
    # what the setting's description says about ratio 1 (one optimiser step with old_logprobs=trainer)
    same = torch.allclose(setting_grad(kind, {name: value}, on_policy=True), setting_grad(kind, {}, on_policy=True))
    assert same == inert
    for other in POLICY_LOSSES.names():
        fields = getattr(POLICY_LOSSES.get(other), "Settings", None)
        if fields is None or name not in fields.model_fields:
            with pytest.raises(ConfigError, match=f"train.loss.settings.{name}: not a setting of train.loss.kind={other}"):
                setting_grad(other, {name: value})


def test_every_registered_loss_runs_with_its_default_settings():
    logp, old, adv, mask, chunks, rollout = data(0)
    for kind in POLICY_LOSSES.names():
        loss, met = policy_loss(loss_cfg(kind), logp, old, adv, mask, chunk_ids=chunks, rollout_logprobs=rollout)
        assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in met.values())
        assert met["loss/ratio_std"] > 0


def test_a_loss_setting_default_is_written_once_in_its_settings_model():
    """The settings model holds each default; the function's keywords have none, and a direct call that
    leaves them out gets the model's defaults (what the trainer passes)."""
    logp, old, adv, mask, chunks, rollout = data(0)
    context = {"mask": mask > 0, "chunk_ids": chunks, "rollout_logprobs": rollout}
    for kind in POLICY_LOSSES.names():
        fn = POLICY_LOSSES.get(kind)
        model = getattr(fn, "Settings", None)
        if model is None:
            continue
        params = inspect.signature(fn).parameters
        for name in model.model_fields:
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (kind, name)
            assert params[name].default is inspect.Parameter.empty, (kind, name)
        ctx = {k: v for k, v in context.items() if k in params}
        bare, _ = fn(logp, old, adv, **ctx)
        explicit, _ = fn(logp, old, adv, **ctx, **model().model_dump())
        assert torch.equal(bare, explicit), kind


def test_with_settings_refuses_a_setting_the_function_does_not_take():
    from pydantic import BaseModel

    from arborl.config.kinds import with_settings

    class Settings(BaseModel):
        clip: float = 0.2

    with pytest.raises(TypeError, match="clip"):
        @with_settings(Settings)
        def loss(logp, old_logp, advantages, *, scale):
            return logp