"""The training step's memory estimate and its "will not fit" error (train/memory.py): fired before any
forward, naming the knob that helps, and never on defaults that fit."""

from __future__ import annotations

import pytest
import torch

from arborl.config import TrainConfig
from arborl.models import tiny_llama
from arborl.train.memory import GB, TrainMemoryError
from arborl.train.trainer import Trainer
from arborl.types import Sample


def _samples(n: int = 4, length: int = 60) -> list[Sample]:
    out = []
    for k in range(n):
        toks = [(3 * k + 5 * i) % 50 + 1 for i in range(length)]
        mask = [0] * 10 + [1] * (length - 10)
        out.append(Sample(episode_id=f"e{k}", group_id=f"g{k // 2}", token_ids=toks, loss_mask=mask,
                          rollout_logprobs=[-1.0 * m for m in mask], versions=[0 if m else -1 for m in mask],
                          chunk_ids=[0] * length, advantages=[(1.0 if k % 2 else -1.0) * m for m in mask]))
    return out


def _model(vocab: int = 64):
    return tiny_llama(layers=2, hidden=32, vocab=vocab, heads=4, kv_heads=2, seed=0)


def test_a_step_that_cannot_fit_fails_before_any_forward_and_names_the_knob():
    trainer = Trainer(_model(), TrainConfig(packing="flat"))
    need = trainer.check_memory(240)  # the four samples' tokens: one micro-batch
    assert need.activations > need.logits
    static = need.weights + need.gradients + need.optimizer
    trainer.cfg = trainer.cfg.model_copy(update={"memory_limit_gb": (static + need.activations / 2) / GB})
    before = [p.detach().clone() for p in trainer.params]
    forwards = []
    trainer._forward = lambda *a, **k: forwards.append(1)  # the step itself must never run
    with pytest.raises(TrainMemoryError, match=r"train\.micro_batch_tokens.*activation_checkpointing"):
        trainer.train_step(_samples())
    assert not forwards and trainer.step == 0
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params))


def test_with_some_layers_checkpointed_the_error_says_to_checkpoint_more():
    trainer = Trainer(_model(), TrainConfig(packing="flat", activation_checkpointing=True,
                                            activation_checkpointing_layers=1))
    need = trainer.check_memory(240)
    static = need.weights + need.gradients + need.optimizer
    trainer.cfg = trainer.cfg.model_copy(update={"memory_limit_gb": (static + need.activations / 2) / GB})
    with pytest.raises(TrainMemoryError, match=r"micro_batch_tokens.*activation_checkpointing_layers, now 1"):
        trainer.train_step(_samples())


def test_the_estimate_grows_with_the_micro_batch_and_the_logits_knob_bounds_it():
    big_vocab = 4096
    plain = Trainer(_model(big_vocab), TrainConfig(logits_chunk_tokens=0))
    chunked = Trainer(_model(big_vocab), TrainConfig(logits_chunk_tokens=8))
    a, b = plain.check_memory(100), plain.check_memory(200)
    assert b.activations == 2 * a.activations > 0 and b.logits == 2 * a.logits == 2 * 100 * big_vocab * 4 * 3
    c = chunked.check_memory(200)
    assert c.logits == 8 * big_vocab * 4 * 3 and c.activations == b.activations
    # the logits dominate without chunks: the error says which knob bounds them
    limit = (c.total + b.total) / 2 / GB
    with pytest.raises(TrainMemoryError, match="logits_chunk_tokens"):
        Trainer(_model(big_vocab), TrainConfig(logits_chunk_tokens=0, memory_limit_gb=limit)).check_memory(200)
    Trainer(_model(big_vocab), TrainConfig(logits_chunk_tokens=8, memory_limit_gb=limit)).check_memory(200)


def test_checkpointing_lowers_the_measured_activations_and_lora_the_static_part():
    pytest.importorskip("peft")
    full = Trainer(_model(), TrainConfig()).check_memory(1000)
    ckpt = Trainer(_model(), TrainConfig(activation_checkpointing=True)).check_memory(1000)
    lora = Trainer(_model(), TrainConfig(lora_rank=2)).check_memory(1000)
    assert ckpt.activations < full.activations / 2
    assert full.optimizer == 2 * full.gradients == 2 * full.weights
    assert lora.gradients < full.gradients / 5 and lora.weights >= full.weights


def test_off_and_defaults():
    assert Trainer(_model(), TrainConfig(memory_limit_gb=0)).check_memory(4096) is None
    trainer = Trainer(_model(), TrainConfig())  # the device's memory: a tiny model always fits
    trainer.train_step(_samples())
    assert trainer.step == 1



def test_the_probe_forward_runs_once_per_trainer(monkeypatch):
    from arborl.train import trainer as trainer_module

    calls = []
    real = trainer_module.activation_bytes_per_token
    monkeypatch.setattr(trainer_module, "activation_bytes_per_token", lambda *a: calls.append(1) or real(*a))
    trainer = Trainer(_model(), TrainConfig())
    trainer.train_step(_samples())
    trainer.train_step(_samples())
    assert len(calls) == 1 and trainer.step == 2
