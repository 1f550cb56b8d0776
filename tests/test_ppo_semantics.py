"""The trainer's policy-gradient semantics on a tiny Llama and hand-built samples: ppo_epochs x minibatches
optimiser steps, the old policy (trainer recompute at step start vs recorded rollout log-probs), decoupled
PPO, the per-step ratio / clip / KL metrics, and that the loss kinds agree on-policy and differ off-policy.

Gradients are read from the parameters after ``train_step`` (those of its last optimiser step; grad_clip=0
so they are the raw gradients)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from arborl.config import LossConfig, TrainConfig
from arborl.models import tiny_llama
from arborl.train.corrections import decoupled_weights
from arborl.train.trainer import Trainer, minibatch_split
from arborl.types import Sample

VOCAB = 96
LR = 1e-3  # large enough that a second optimiser step sees ratios beyond the clip, small enough that not all are


def older(seed: int = 0, noise: float = 0.03):
    """The default model with perturbed weights: an older policy whose log-probs differ moderately."""
    m = model()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return m


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is faster


def model(seed: int = 0):
    return tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=seed)


def make_samples(seed: int = 0, groups: int = 2, size: int = 3) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 6))]
        for _ in range(size):
            resp = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 8))]
            toks = prompt + resp
            mask = [0] * len(prompt) + [1] * len(resp)
            adv = rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5)
            out.append(Sample(
                episode_id=f"e{len(out)}", group_id=f"g{g}", token_ids=toks, loss_mask=mask,
                rollout_logprobs=[0.0] * len(toks), versions=[0 if m else -1 for m in mask],
                chunk_ids=[0] * len(toks), advantages=[adv if m else 0.0 for m in mask], reward=adv,
            ))
    return out


@torch.no_grad()
def with_rollout_logprobs(samples: list[Sample], policy, shift: float = 0.0) -> list[Sample]:
    """Set each sample's rollout log-probs to ``policy``'s (plus ``shift``) on its loss tokens."""
    for s in samples:
        ids = torch.tensor([s.token_ids])
        logits = policy(ids).logits[0, :-1].double()
        lp = torch.log_softmax(logits, -1)[torch.arange(len(s.token_ids) - 1), ids[0, 1:]]
        s.rollout_logprobs = [0.0] + [float(x) + shift if m else 0.0 for x, m in zip(lp, s.loss_mask[1:])]
    return samples


def step(samples, **cfg) -> tuple[dict[str, float], torch.Tensor, Trainer]:
    loss = {k[5:]: cfg.pop(k) for k in list(cfg) if k.startswith("loss_")}  # loss_kind, loss_<its setting>
    shared = {k: v for k, v in loss.items() if k in LossConfig.model_fields}
    loss = {**shared, "settings": {k: v for k, v in loss.items() if k not in shared}}
    cfg.setdefault("packing", "flat")  # the cheapest forward on a busy CPU; packing is tested elsewhere
    t = Trainer(model(), TrainConfig(grad_clip=0.0, lr=cfg.pop("lr", LR), loss=LossConfig(**loss), **cfg))
    metrics = t.train_step(samples)
    return metrics, grads(t), t


def grads(t: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in t.params])


def differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).norm().item() > 1e-3 * b.norm().item()


# ---------------------------------------------------------------- on-policy: ratio 1, every loss the same


def test_on_policy_one_step_every_kind_and_clip_gives_the_same_gradient():
    samples = with_rollout_logprobs(make_samples(1), model())  # ipa: no train/rollout mismatch to mask
    m, want, _ = step(samples)
    assert m["loss/ratio_mean"] == pytest.approx(1.0) and m["loss/ratio_std"] == 0.0
    assert m["loss/approx_kl"] == 0.0 and m["loss/clip_frac"] == 0.0 and m["train/optimizer_steps"] == 1
    for kind, knobs in [
        ("ppo", {"loss_clip_low": 0.01, "loss_clip_high": 0.01, "loss_dual_clip": 1.01}),
        ("cispo", {"loss_eps_high": 0.0, "loss_eps_low": 0.5}), ("gspo", {}), ("gmpo", {}), ("sapo", {}),
        ("kl_cov", {}), ("ipa", {}),
    ]:
        _, got, _ = step(samples, loss_kind=kind, **knobs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7, msg=f"{kind} {knobs}")


# ---------------------------------------------------------------- off-policy: a second epoch


def test_second_epoch_makes_the_kinds_and_the_clip_differ():
    samples = make_samples(2)
    m, ppo, _ = step(samples, ppo_epochs=2)
    assert m["train/optimizer_steps"] == 2
    assert m["loss/ratio_std"] > 0 and m["loss/approx_kl"] > 0  # the second step's ratio is not 1
    assert m["loss/clip_frac_high"] + m["loss/clip_frac_low"] > 0  # the first step moved some tokens past the clip
    _, cispo, _ = step(samples, ppo_epochs=2, loss_kind="cispo")
    _, tight, _ = step(samples, ppo_epochs=2, loss_clip_low=0.01, loss_clip_high=0.01)
    _, loose, _ = step(samples, ppo_epochs=2, loss_clip_low=0.9, loss_clip_high=10.0)
    assert differ(cispo, ppo) and differ(tight, ppo) and differ(loose, ppo) and differ(tight, loose)
    # one epoch: the same knobs change nothing
    _, one_ppo, _ = step(samples)
    _, one_tight, _ = step(samples, loss_clip_low=0.01, loss_clip_high=0.01)
    torch.testing.assert_close(one_tight, one_ppo, rtol=0, atol=0)


def test_minibatches_split_the_batch_into_optimiser_steps():
    samples = make_samples(3, groups=3, size=2)
    assert minibatch_split(samples, 2) == [[0, 1, 2], [3, 4, 5]]
    assert minibatch_split(samples, 100) == [[i] for i in range(6)]
    m1, g1, _ = step(samples)
    m2, g2, _ = step(samples, minibatches=2)
    m4, _, _ = step(samples, minibatches=3, ppo_epochs=2)
    assert (m1["train/optimizer_steps"], m2["train/optimizer_steps"], m4["train/optimizer_steps"]) == (1, 2, 6)
    assert differ(g2, g1)  # the last step sees half the batch, through a policy already updated once
    assert m2["loss/ratio_std"] > 0 and m1["loss/ratio_std"] == 0
    assert m2["train/loss_tokens"] == m1["train/loss_tokens"] == m4["loss/tokens"]


def test_the_old_policy_is_the_policy_at_the_start_of_the_step():
    """Two epochs with old_logprobs=trainer == two one-epoch steps whose behaviour log-probs are the
    step-start policy's (the second step's ratio is taken against them, not against the updated policy)."""
    samples = make_samples(4)
    _, two_epochs, _ = step(samples, ppo_epochs=2)
    t = Trainer(model(), TrainConfig(grad_clip=0.0, lr=LR, old_logprobs="rollout"))
    with_rollout_logprobs(samples, t.model)
    t.train_step(samples)
    t.train_step(samples)  # same Adam state, gradient at the same parameters, pi_old = the start policy
    torch.testing.assert_close(two_epochs, grads(t), rtol=1e-3, atol=1e-6)
    # with the old policy recomputed at every optimiser step, the second gradient would be the on-policy one
    t2 = Trainer(model(), TrainConfig(grad_clip=0.0, lr=LR))
    t2.train_step(samples)
    t2.train_step(samples)
    assert differ(two_epochs, grads(t2))


# ---------------------------------------------------------------- off-policy: rollout log-probs of an older policy


def test_rollout_old_logprobs_from_an_older_policy_make_the_kinds_differ():
    samples = with_rollout_logprobs(make_samples(5), older())  # the behaviour policy is an older one
    m, ppo, _ = step(samples, old_logprobs="rollout")
    assert m["train/optimizer_steps"] == 1 and m["loss/ratio_std"] > 0 and m["loss/approx_kl"] > 0
    assert m["loss/clip_frac"] > 0
    assert m["loss/ratio_min"] <= m["loss/ratio_mean"] <= m["loss/ratio_max"]
    _, cispo, _ = step(samples, old_logprobs="rollout", loss_kind="cispo")
    _, tight, _ = step(samples, old_logprobs="rollout", loss_clip_low=0.01, loss_clip_high=0.01)
    _, trainer, _ = step(samples)  # old_logprobs=trainer ignores the stale log-probs: ratio 1
    assert differ(cispo, ppo) and differ(tight, ppo) and differ(trainer, ppo)


# ---------------------------------------------------------------- decoupled PPO


def test_decoupled_weights_are_prox_over_behaviour_dropped_above_the_cap():
    prox = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
    behav = torch.tensor([[-1.5, -1.0, -3.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, met = decoupled_weights(prox, behav, mask, cap=5.0)
    want = [math.exp(0.5), math.exp(-1.0), 0.0, 0.0]  # exp(2.5) > 5: dropped; off the mask: 0
    torch.testing.assert_close(w, torch.tensor([want], dtype=torch.float64))
    assert met["decoupled/masked_frac"] == pytest.approx(1 / 3)
    w, met = decoupled_weights(prox, behav, mask, cap=None)
    assert w[0, 2].item() == pytest.approx(math.exp(2.5)) and met["decoupled/masked_frac"] == 0


def test_decoupled_ppo_weights_the_loss_by_prox_over_behaviour():
    samples = with_rollout_logprobs(make_samples(6), older())
    m, dec, _ = step(samples, decoupled=True, decoupled_weight_cap=None)
    _, plain, _ = step(samples)
    assert differ(dec, plain) and m["decoupled/weight_mean"] > 0
    # it equals PPO around the proximal policy with correction weights pi_prox / pi_behav (token-level TIS, no cap)
    _, tis, _ = step(samples, correction={"mode": "tis", "tis_cap": 1e9})
    torch.testing.assert_close(dec, tis, rtol=1e-4, atol=1e-7)
    # the cap bites only where a weight exceeds it, and only with decoupled
    m_cap, capped, _ = step(samples, decoupled=True, decoupled_weight_cap=1.0)
    assert m_cap["decoupled/masked_frac"] > 0 and differ(capped, dec)
    _, plain_cap, _ = step(samples, decoupled_weight_cap=1.0)
    torch.testing.assert_close(plain_cap, plain, rtol=0, atol=0)


def test_decoupled_clips_around_the_proximal_policy_over_two_epochs():
    samples = with_rollout_logprobs(make_samples(7), older())
    _, dec, _ = step(samples, decoupled=True, ppo_epochs=2, decoupled_weight_cap=None)
    _, rollout_old, _ = step(samples, old_logprobs="rollout", ppo_epochs=2)
    assert differ(dec, rollout_old)
    with pytest.raises(ValidationError, match="old_logprobs=trainer"):
        TrainConfig(decoupled=True, old_logprobs="rollout")


# ---------------------------------------------------------------- the train knobs are documented as tested here


def test_default_step_is_one_optimiser_step_with_ratio_one():
    cfg = TrainConfig()
    assert (cfg.ppo_epochs, cfg.minibatches, cfg.decoupled, cfg.old_logprobs) == (1, 1, False, "trainer")
    for name in ("ppo_epochs", "minibatches", "decoupled", "decoupled_weight_cap"):
        assert TrainConfig.model_fields[name].description
    assert "only with decoupled=true" in TrainConfig.model_fields["decoupled_weight_cap"].description
