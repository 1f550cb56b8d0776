"""Trainer: micro-batching (sized and packed once per step), packing modes, resume equivalence, LoRA publishing."""

from __future__ import annotations

import random

import pytest
import torch

import arborl.train.trainer as trainer_module
from arborl.config import TrainConfig
from arborl.models import tiny_llama
from arborl.prefix import RadixTree
from arborl.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from arborl.train.packing import pack
from arborl.train.trainer import Trainer, micro_batches
from arborl.types import Sample

VOCAB = 128


def model(seed=0):
    return tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=seed)


def make_samples(seed: int, groups: int = 2, size: int = 3) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
        for _ in range(size):
            resp = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
            toks = prompt + resp
            mask = [0] * len(prompt) + [1] * len(resp)
            adv = rng.uniform(-1, 1)
            out.append(
                Sample(
                    episode_id=f"e{len(out)}", group_id=f"g{g}", token_ids=toks, loss_mask=mask,
                    rollout_logprobs=[-rng.uniform(3, 6) if m else 0.0 for m in mask],
                    versions=[0 if m else -1 for m in mask], chunk_ids=[0] * len(toks),
                    advantages=[adv if m else 0.0 for m in mask], reward=adv,
                )
            )
    return out


def params_of(m) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def test_micro_batches_keep_groups_together_and_respect_budget():
    s = make_samples(1, groups=3, size=4)
    for budget in (1, 20, 40, 10_000):
        for tree in (False, True):
            mbs = micro_batches(s, budget, tree=tree)
            assert sorted(i for mb, _ in mbs for i in mb) == list(range(len(s)))
            for mb, prefixes in mbs:
                fresh: RadixTree[None] = RadixTree()
                for i in mb:
                    fresh.insert(s[i].token_ids)
                computed = fresh.total_tokens if tree else sum(len(s[i].token_ids) for i in mb)
                assert len(mb) == 1 or computed <= budget
                groups = [s[i].group_id for i in mb]
                assert groups == sorted(groups)
                if tree:  # the tree that sized the micro-batch is the one of exactly its samples (pack reuses it)
                    assert prefixes.sequences() == fresh.sequences()
                    assert prefixes.total_tokens == fresh.total_tokens
                else:
                    assert prefixes is None


class RepackingTrainer(Trainer):
    """The trainer as it was before packing once per step: every pass packs its micro-batches afresh
    (building their prefix trees again), and the proximal forward micro-batches the whole batch anew."""

    def train_step(self, samples):
        self.samples = samples
        return super().train_step(samples)

    def _micro_step(self, samples, rows, batch, *rest):
        cfg = self.cfg
        fresh = pack([samples[i].token_ids for i in rows], mode=cfg.packing, token_budget=cfg.micro_batch_tokens,
                     min_saving=cfg.packing_min_saving)
        return super()._micro_step(samples, rows, fresh, *rest)

    @torch.no_grad()
    def _logprobs(self, plans):
        cfg, out = self.cfg, {}
        for idx, _ in micro_batches(self.samples, cfg.micro_batch_tokens, tree=cfg.packing != "flat"):
            batch = pack([self.samples[i].token_ids for i in idx], mode=cfg.packing,
                         token_budget=cfg.micro_batch_tokens, min_saving=cfg.packing_min_saving)
            for i, lp in zip(idx, self._forward(batch)):
                out[i] = lp.detach()
        return out


@pytest.mark.parametrize("knobs, exact", [
    (dict(ppo_epochs=3, packing="tree", micro_batch_tokens=24), True),
    (dict(ppo_epochs=2, packing="auto", micro_batch_tokens=30, decoupled=True), True),
    (dict(ppo_epochs=2, packing="flat", micro_batch_tokens=20, old_logprobs="rollout"), True),
    # several parts: pi_old now comes from each part's own packed forward, not from a whole-batch
    # micro-batching, so the summation order differs: compared in float64, where Adam cannot amplify
    # float32 rounding (~1e-7 of a gradient) past any fixed tolerance on the parameters
    (dict(ppo_epochs=2, minibatches=2, packing="tree", micro_batch_tokens=30), False),
])
def test_micro_batches_are_packed_once_per_step_with_the_same_loss_and_grads(monkeypatch, knobs, exact):
    samples = make_samples(5, groups=3, size=3)
    cfg = TrainConfig(lr=1e-2, grad_clip=0.0, **knobs)
    calls = []

    def counted_pack(*args, **kw):
        calls.append(kw.get("tree"))
        return pack(*args, **kw)

    monkeypatch.setattr(trainer_module, "pack", counted_pack)
    dtype = torch.float32 if exact else torch.float64
    once = Trainer(model().to(dtype), cfg)
    got = once.train_step(samples)
    micro = sum(len(micro_batches([samples[i] for i in part], cfg.micro_batch_tokens, tree=cfg.packing != "flat"))
                for part in trainer_module.minibatch_split(samples, cfg.minibatches))
    assert len(calls) == micro  # once per micro-batch, whatever ppo_epochs and the proximal forward
    assert all((t is None) == (cfg.packing == "flat") for t in calls)  # with the tree that sized it
    monkeypatch.undo()

    again = RepackingTrainer(model().to(dtype), cfg)
    want = again.train_step(samples)
    assert params_of(once.model).dtype == dtype
    got_grads = torch.cat([p.grad.flatten() for p in once.params])
    want_grads = torch.cat([p.grad.flatten() for p in again.params])
    for key in ("train/step_s",):
        got.pop(key), want.pop(key)
    if exact:
        assert torch.equal(got_grads, want_grads) and torch.equal(params_of(once.model), params_of(again.model))
        assert got == want
    else:
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(params_of(once.model), params_of(again.model), rtol=0, atol=1e-9)
        assert got.keys() == want.keys() and got["loss/total"] == pytest.approx(want["loss/total"], rel=1e-9)


@pytest.mark.parametrize("packing", ["flat", "tree"])
def test_step_is_independent_of_micro_batching_and_packing(packing):
    samples = make_samples(2)
    ref = model()
    Trainer(ref, TrainConfig(lr=1e-2, packing="flat", micro_batch_tokens=10_000)).train_step(samples)
    m = model()
    metrics = Trainer(m, TrainConfig(lr=1e-2, packing=packing, micro_batch_tokens=16)).train_step(samples)
    assert torch.allclose(params_of(m), params_of(ref), atol=1e-5)
    assert metrics["train/grad_norm"] > 0 and metrics["train/step"] == 1
    assert not torch.allclose(params_of(m), params_of(model()))  # it trained


def test_tree_packing_computes_fewer_tokens_on_groups():
    samples = make_samples(3, groups=1, size=6)
    metrics = Trainer(model(), TrainConfig(packing="tree")).train_step(samples)
    assert metrics["train/packed_tokens"] < metrics["train/flat_tokens"]


def test_all_masked_batch_is_skipped():
    s = make_samples(4)
    for x in s:
        x.loss_mask = [0] * len(x.loss_mask)
    m = model()
    assert Trainer(m, TrainConfig()).train_step(s)["train/skipped"] == 1.0
    assert torch.equal(params_of(m), params_of(model()))


def test_resume_equals_straight_run(tmp_path):
    cfg = TrainConfig(lr=5e-3, loss={"entropy_coef": 0.01, "kl_coef": 0.05})
    batches = [make_samples(10 + i) for i in range(4)]

    straight = Trainer(model(), cfg)
    for b in batches:
        straight.train_step(b)

    first = Trainer(model(), cfg)
    for b in batches[:2]:
        first.train_step(b)
    torch.manual_seed(123)
    save_checkpoint(tmp_path / "ckpt", first, {"cursor": 2})
    expect_rng = torch.rand(3)
    torch.manual_seed(999)  # a resumed process starts with other RNG state
    resumed = Trainer(model(seed=5), cfg)
    extra = load_checkpoint(tmp_path / "ckpt", resumed)
    assert extra == {"cursor": 2} and resumed.step == 2
    assert torch.equal(torch.rand(3), expect_rng)
    for b in batches[extra["cursor"]:]:
        resumed.train_step(b)
    assert torch.allclose(params_of(resumed.model), params_of(straight.model), atol=1e-6, rtol=0)


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(tmp_path, Trainer(model(), TrainConfig()))


def test_engine_state_loads_into_engine_model():
    m = model()
    t = Trainer(m, TrainConfig(lr=1e-2))
    t.train_step(make_samples(6))
    fresh = model(seed=9)
    fresh.load_state_dict(t.engine_state())
    assert torch.equal(params_of(fresh), params_of(m))


def test_lora_trains_adapters_and_publishes_merged_weights():
    pytest.importorskip("peft")
    base = model()
    t = Trainer(base, TrainConfig(lr=5e-2, lora_rank=4))
    for i in range(3):
        t.train_step(make_samples(20 + i))
    merged = model(seed=9)
    merged.load_state_dict(t.engine_state())
    ids = torch.tensor([[1, 5, 9, 11, 3]])
    with torch.no_grad():
        want = t.model(ids).logits
        got = merged(ids).logits
        untouched = model()(ids).logits
    assert torch.allclose(got, want, atol=1e-4)  # (W + sBA)x vs Wx + sBAx: float32 rounding only
    assert not torch.allclose(got, untouched, atol=1e-4)


def test_engine_state_copies_what_training_changes_and_shares_the_frozen_base():
    """Full fine-tuning: a snapshot (a later step does not move it), the tied weight copied once. LoRA: the
    frozen base goes out as the trainer's own tensors (no second full copy), the adapted ones merged anew."""
    pytest.importorskip("peft")
    full = Trainer(model(), TrainConfig(lr=1e-2))
    state = full.engine_state()
    before = {k: v.clone() for k, v in state.items()}
    full.train_step(make_samples(7))
    assert all(torch.equal(state[k], before[k]) for k in state)
    own = {p.data_ptr() for p in full.model.parameters()}
    assert not any(v.data_ptr() in own for v in state.values())

    lora = Trainer(model(), TrainConfig(lr=5e-2, lora_rank=4))
    lora.train_step(make_samples(8))
    state = lora.engine_state()
    base = dict(lora.policy.named_parameters())
    mlp = "model.layers.0.mlp.down_proj.weight"
    assert state[mlp].data_ptr() == base[mlp].data_ptr()  # not adapted: the trainer's frozen tensor
    q = "model.layers.0.self_attn.q_proj.weight"
    assert state[q].data_ptr() != base["model.layers.0.self_attn.q_proj.base_layer.weight"].data_ptr()
    merged = model(seed=9)
    merged.load_state_dict(state)
    assert torch.equal(base["model.layers.0.self_attn.q_proj.base_layer.weight"],
                       model().state_dict()[q])  # loading the merged state left the base as it was


def test_trainer_scores_the_tempered_policy():
    m = model()
    samples = make_samples(30)
    with torch.no_grad():
        for s in samples:  # rollout log-probs under softmax(logits / 0.5), as the engine reports them
            logits = m(torch.tensor([s.token_ids])).logits[0, :-1] / 0.5
            lp = torch.log_softmax(logits, -1)[torch.arange(len(s.token_ids) - 1), torch.tensor(s.token_ids[1:])]
            s.rollout_logprobs = [0.0] + [float(x) if k else 0.0 for x, k in zip(lp, s.loss_mask[1:])]
    hot = Trainer(model(), TrainConfig(), temperature=0.5).train_step(samples)
    cold = Trainer(model(), TrainConfig()).train_step(samples)
    assert hot["mismatch/logp_abs_diff_max"] < 1e-4
    assert cold["mismatch/logp_abs_diff_max"] > 1e-2
    with pytest.raises(Exception, match="temperature"):
        Trainer(model(), TrainConfig(), temperature=0.0)


def test_a_save_interrupted_between_its_renames_still_resumes(tmp_path):
    t = Trainer(model(), TrainConfig())
    t.train_step(make_samples(40))
    save_checkpoint(tmp_path / "ckpt", t, {"step": 1})
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old-123")  # the state a crash mid-save leaves
    fresh = Trainer(model(seed=4), TrainConfig())
    assert load_checkpoint(tmp_path / "ckpt", fresh) == {"step": 1}
    assert torch.equal(params_of(fresh.model), params_of(t.model))
