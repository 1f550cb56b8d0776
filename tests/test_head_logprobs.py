"""Log-probs, entropies and the loss from the last hidden states chunk by chunk (train/head_logprobs.py):
equal to the plain computation over whole logits, gradients included, and the logits kept for the
backward do not grow with the vocabulary."""

from __future__ import annotations

import pytest
import torch

from arborl.config import TrainConfig
from arborl.models import tiny_llama
from arborl.train.head_logprobs import head_logprobs
from arborl.train.packing import pack, packed_logprobs
from arborl.train.trainer import Trainer
from arborl.types import Sample

SAMPLES = [  # a GRPO-like group (shared prompt, branches) and a multi-turn extension: shared positions
    [1, 5, 9, 2, 7, 3, 3, 8],  # predict several next tokens under tree packing
    [1, 5, 9, 2, 4, 4, 6],
    [1, 5, 9, 2, 7, 3, 3, 8, 10, 11, 2, 5],
    [6, 2, 2, 9, 1],
]


def _model(dtype=torch.float64, tie=False, vocab=16, seed=3):
    return tiny_llama(layers=2, hidden=32, vocab=vocab, heads=4, kv_heads=2, seed=seed, dtype=dtype, tie_embeddings=tie)


def _loss(lps, ents) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    total = lps[0].new_zeros(())
    for lp, ent in zip(lps, ents):
        w = torch.randn(lp.shape, generator=g, dtype=lp.dtype)
        total = total + (w * lp).sum() - 0.01 * ent.sum()
    return total


def _run(model, batch, chunk, temperature=1.0):
    model.zero_grad(set_to_none=True)
    lps, ents = packed_logprobs(model, batch, with_entropy=True, temperature=temperature, logits_chunk=chunk)
    _loss(lps, ents).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [lp.detach() for lp in lps], [e.detach() for e in ents], grads


@pytest.mark.parametrize("mode", ["flat", "tree"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_chunked_equals_plain_with_every_gradient_float64(mode, tie, chunk):
    model = _model(tie=tie)
    batch = pack(SAMPLES, mode=mode)
    if mode == "tree":  # shared positions: one logit row serves several (sample, t) pairs
        assert batch.logit_pos.numel() < batch.pair_logit.numel()
    ref = _run(model, batch, 0, temperature=0.7)
    got = _run(model, batch, chunk, temperature=0.7)
    for a, b in zip(ref[0] + ref[1], got[0] + got[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    assert ref[2].keys() == got[2].keys() and (tie or "lm_head.weight" in got[2])
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=0, atol=1e-12, msg=name)


def test_chunked_float32_against_float64_reference():
    """float32 chunked within float32 tolerance of the float64 plain computation, gradients too."""
    ref_model = _model(torch.float64)
    model = _model(torch.float32)
    batch = pack(SAMPLES, mode="tree")
    ref = _run(ref_model, batch, 0)
    got = _run(model, batch, 2)
    for a, b in zip(ref[0] + ref[1], got[0] + got[1]):
        torch.testing.assert_close(b.double(), a, rtol=1e-5, atol=1e-5)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name].double(), ref[2][name], rtol=1e-4, atol=1e-5, msg=name)


def test_no_grad_and_lora_paths():
    """Without gradients (proximal / reference log-probs) the chunks give the plain values; under LoRA the
    adapters below the head get the plain gradients."""
    pytest.importorskip("peft")
    samples = []
    for k, s in enumerate(SAMPLES):
        mask = [0, 0, 0] + [1] * (len(s) - 3)
        samples.append(Sample(
            episode_id=f"e{k}", group_id="g0", token_ids=s, loss_mask=mask,
            rollout_logprobs=[-2.0 * m for m in mask], versions=[0 if m else -1 for m in mask],
            chunk_ids=[0] * len(s), advantages=[(1.0 if k % 2 else -1.0) * m for m in mask],
        ))
    grads = []
    for chunk in (0, 2):
        cfg = TrainConfig(lr=1e-3, lora_rank=4, logits_chunk_tokens=chunk, micro_batch_tokens=16)
        cfg.loss.entropy_coef = 0.01
        torch.manual_seed(0)  # the LoRA A matrices' draw
        trainer = Trainer(_model(torch.float64, seed=5), cfg)
        with torch.no_grad():
            plain = packed_logprobs(trainer.policy, pack(SAMPLES), logits_chunk=0)
            chunked = packed_logprobs(trainer.policy, pack(SAMPLES), logits_chunk=chunk)
        for a, b in zip(plain, chunked):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
        trainer.optimizer.step = lambda: None  # keep the weights: compare the step's gradients
        trainer.train_step(samples)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert grads[0] and any("lora_" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-12, msg=name)


def _saved_activation_bytes(model, batch, chunk) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for the backward of one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack_hook(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        packed_logprobs(model, batch, with_entropy=True, logits_chunk=chunk)
    return sum(seen.values())


def test_logits_kept_for_backward_do_not_grow_with_the_vocabulary():
    batch = pack([list(range(1, 40)), list(range(2, 50))], mode="flat")
    small = {c: _saved_activation_bytes(_model(torch.float32, vocab=64), batch, c) for c in (0, 16)}
    large = {c: _saved_activation_bytes(_model(torch.float32, vocab=8192), batch, c) for c in (0, 16)}
    positions = batch.logit_pos.numel()
    # plain: the whole logits (and their softmax) are kept: at least positions x vocabulary x 4 bytes more
    assert large[0] - small[0] >= positions * (8192 - 64) * 4
    # chunked: only hidden states are kept, the same bytes whatever the vocabulary
    assert large[16] == small[16]
    assert large[16] < large[0] / 5


def test_head_logprobs_no_positions_and_bad_rows():
    model = _model()
    hidden = torch.randn(5, 32, dtype=torch.float64)
    rows = torch.tensor([4, 0, 0, 2])
    targets = torch.tensor([1, 2, 3, 4])
    plain, _ = head_logprobs(model, hidden, rows, targets, chunk=0)
    for chunk in (1, 2, 4, 5, 9):
        got, ent = head_logprobs(model, hidden, rows, targets, chunk=chunk, with_entropy=True)
        torch.testing.assert_close(got, plain, rtol=0, atol=1e-12)
        assert ent.shape == rows.shape
