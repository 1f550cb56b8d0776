"""Supervised fine-tuning through the policy trainer: the same model (LoRA or full), micro-batching,
tree packing and gradient clipping as an RL step, with the token loss ``sft`` (-logp on the samples'
loss-masked tokens, token mean) instead of a policy-gradient loss.

``sft_config(train)`` is the trainer config of an SFT step; ``sft_mode(trainer, cfg)`` runs a trainer
built for RL in SFT mode for a while (own config and optimiser, restored afterwards: the RL optimiser
starts fresh from the fine-tuned weights); ``sft_epochs`` runs the steps; ``masked_nll`` is the mean
negative log-likelihood per loss token (what a held-out set of demonstrations is measured by).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator

import torch

from arborl.config import TrainConfig
from arborl.heap import release_free_memory
from arborl.train.packing import pack, packed_logprobs
from arborl.train.trainer import Trainer, micro_batches
from arborl.types import InvalidRequestError, Sample


def sft_config(train: TrainConfig) -> TrainConfig:
    """``train`` with the SFT loss: one optimiser step per batch, no KL / entropy / correction terms."""
    loss = train.loss.model_copy(update={"kind": "sft", "settings": {}, "kl_coef": 0.0, "entropy_coef": 0.0, "aggregation": "token_mean"})
    return train.model_copy(update={
        "loss": loss, "lr": train.sft.lr or train.lr, "ppo_epochs": 1, "minibatches": 1, "old_logprobs": "trainer",
        "decoupled": False, "correction": train.correction.model_copy(update={"mode": "none"}),
        "mtp": train.mtp.model_copy(update={"enabled": False}),
    })


@contextlib.contextmanager
def sft_mode(trainer: Trainer, cfg: TrainConfig) -> Iterator[Trainer]:
    """``trainer`` with ``sft_config(cfg)`` and a fresh optimiser at the SFT learning rate; its own
    config and optimiser (untouched) come back afterwards, the SFT optimiser's state and the gradients go."""
    saved_cfg, saved_opt, saved_step = trainer.cfg, trainer.optimizer, trainer.step
    scfg = sft_config(cfg)
    trainer.cfg = scfg
    trainer.optimizer = torch.optim.AdamW(trainer.params, lr=scfg.lr, betas=scfg.betas, eps=scfg.adam_eps,
                                          weight_decay=scfg.weight_decay)
    try:
        yield trainer
    finally:
        trainer.cfg, trainer.optimizer, trainer.step = saved_cfg, saved_opt, saved_step
        for p in trainer.params:  # the last SFT step's gradients: a whole model's worth that nothing reads again
            p.grad = None
        release_free_memory()  # and the SFT optimizer's moments, gone with it


def sft_epochs(trainer: Trainer, samples: list[Sample], *, epochs: int, batch: int, seed: int = 0,
               on_step: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """``epochs`` passes over ``samples`` in seeded random order, ``batch`` samples per optimiser step;
    returns each step's trainer metrics (``on_step`` sees them as they come)."""
    if not samples:
        raise InvalidRequestError("nothing to fine-tune on: no transcripts")
    if trainer.cfg.loss.kind != "sft":
        raise InvalidRequestError("sft_epochs needs a trainer in SFT mode (train.sft.sft_mode / sft_config)")
    rng = random.Random(seed)
    out = []
    for epoch in range(epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for k in range(0, len(order), batch):
            m = trainer.train_step([samples[i] for i in order[k : k + batch]])
            m["sft/epoch"] = float(epoch + 1)
            out.append(m)
            if on_step is not None:
                on_step(m)
    return out


@torch.no_grad()
def masked_nll(trainer: Trainer, samples: list[Sample]) -> float:
    """Mean negative log-likelihood (nats) per loss-masked token of ``samples`` under the trainer's
    policy (temperature 1), packed as the trainer packs."""
    cfg = trainer.cfg
    was = trainer.model.training
    trainer.model.eval()
    total = tokens = 0.0
    try:
        for idx, prefixes in micro_batches(samples, cfg.micro_batch_tokens, tree=cfg.packing != "flat"):
            batch = pack([samples[i].token_ids for i in idx], mode=cfg.packing, token_budget=cfg.micro_batch_tokens,
                         min_saving=cfg.packing_min_saving, tree=prefixes)
            for i, lp in zip(idx, packed_logprobs(trainer.policy, batch, logits_chunk=cfg.logits_chunk_tokens)):
                m = torch.tensor(samples[i].loss_mask[1:], dtype=lp.dtype, device=lp.device)
                total -= float((lp * m).sum())
                tokens += float(m.sum())
    finally:
        trainer.model.train(was)
    return total / tokens if tokens else math.nan
