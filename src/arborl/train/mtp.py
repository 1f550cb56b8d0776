"""Online training of the MTP drafter's head (I3; Forge, slime): once per RL step, after the policy step,
on the step's rollout tokens.

The policy runs once without gradients (its hidden states are detached: the backbone never learns
from the head). For each generated run of a sample -- positions a .. b-1 of one engine call -- the
head sees what the engine's drafter sees: the pairs (h_{i-1}, t_i) for i = a+1 .. b-1, causal over
the run (``engine/specdec/mtp.py``), and at position i it is taught the policy's own next-token
distribution p_i (what the verifier accepts against):

    topk_kl:  L_i = sum_{v in topK(p_i)} p~_i(v) (log p~_i(v) - log q_i(v)),  p~ = p renormalised on its top K
    hard_ce:  L_i = -log q_i(t_{i+1})                                         (the sampled token)

q_i is the head's full-vocabulary distribution, so mass it puts outside the top K is penalised too.
The loss is the mean over positions; the head has its own AdamW.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from arborl.config import Config, MTPTrainConfig
from arborl.engine.specdec.mtp import MTP_FILE, MTPHead, head_state, load_head, mtp_init_path, save_head
from arborl.models.forward import DecoderShape, decoder_hidden, lm_logits
from arborl.types import ArborlError, Sample

STATE_FILE = "mtp_trainer.pt"  # the head's optimiser in a checkpoint (trainer state, not exported)


def mtp_loss(policy_logits: torch.Tensor, head_logits: torch.Tensor, next_tokens: torch.Tensor, kind: str, top_k: int) -> torch.Tensor:
    """Per-position loss [n] of head logits [n, vocab] against the policy's logits [n, vocab] (topk_kl)
    or the sampled next tokens [n] (hard_ce); see the module docstring."""
    logq = torch.log_softmax(head_logits.float(), dim=-1)
    if kind == "hard_ce":
        return -logq.gather(-1, next_tokens[:, None])[:, 0]
    if kind != "topk_kl":
        raise ValueError(f"unknown MTP loss {kind!r} (topk_kl, hard_ce)")
    top, idx = policy_logits.float().topk(min(top_k, policy_logits.shape[-1]), dim=-1)
    logp = torch.log_softmax(top, dim=-1)  # the top K renormalised
    return (logp.exp() * (logp - logq.gather(-1, idx))).sum(-1)


def generated_runs(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[a, b) spans of consecutive generated tokens (one engine call each)."""
    runs, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class MTPTrainer:
    def __init__(self, policy: nn.Module, cfg: MTPTrainConfig, *, init_path: str | None = None) -> None:
        self.cfg = cfg
        self.policy = policy
        self.head = MTPHead(policy)
        if init_path:
            load_head(self.head, init_path)
        self.params = list(self.head.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        shape = DecoderShape.of(policy)
        self._scaling, self._gqa = shape.scaling, shape.gqa
        self.steps = 0

    @torch.no_grad()
    def _policy_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The policy's hidden states [n, hidden] (before the final norm)."""
        dev = next(self.policy.parameters()).device
        ids = torch.tensor([tokens], device=dev)
        pos = torch.arange(len(tokens), device=dev)[None]

        def make_attend(_layer: int):
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self._scaling,
                                                                  enable_gqa=self._gqa)

        was = self.policy.training
        self.policy.eval()
        h = decoder_hidden(self.policy, ids, pos, make_attend)[0]
        self.policy.train(was)
        return h

    def _targets(self, samples: list[Sample]) -> list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]]:
        """Per generated run long enough to train on: (h_prev, tokens, first position, policy logits, next tokens)."""
        out = []
        for s in samples:
            runs = [(a, b) for a, b in generated_runs(s.loss_mask) if b - a >= 3]
            if not runs:
                continue
            h = self._policy_hidden(s.token_ids)
            toks = torch.tensor(s.token_ids, device=h.device)
            for a, b in runs:
                # head positions i = a+1 .. b-2: input (h_{i-1}, t_i), target p_i / t_{i+1}
                with torch.no_grad():
                    logits = lm_logits(self.policy, h[a + 1 : b - 1])
                out.append((h[a : b - 2], toks[a + 1 : b - 1], a + 1, logits, toks[a + 2 : b]))
        return out

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step's head update; returns ``mtp/*`` metrics (loss before the update, top-1 agreement
        of head and policy = the greedy acceptance of a first draft token)."""
        t0 = time.perf_counter()
        data = self._targets(samples)
        n = sum(len(t) for _, t, _, _, _ in data)
        if not n:
            return {"mtp/tokens": 0.0}
        self.head.train()
        # the shared embeddings, final norm and LM head are the policy's: no gradient reaches them
        shared = [p for p in self.policy.parameters() if p.requires_grad]
        for p in shared:
            p.requires_grad_(False)
        try:
            first_loss, agree = self._fit(data, n)
        finally:
            for p in shared:
                p.requires_grad_(True)
        self.head.eval()
        self.steps += 1
        if self.cfg.save_path:
            save_head(self.head, Path(self.cfg.save_path).expanduser())
        return {"mtp/loss": first_loss, "mtp/top1_agreement": agree / n, "mtp/tokens": float(n),
                "mtp/step_s": time.perf_counter() - t0}

    def _fit(self, data, n: int) -> tuple[float, float]:
        """``iters`` optimiser steps; the loss and the top-1 agreement before the first."""
        first_loss, agree = 0.0, 0.0
        for it in range(self.cfg.iters):
            self.opt.zero_grad(set_to_none=True)
            total = 0.0
            for h_prev, toks, start, pl, nxt in data:
                hl = self.head.causal(h_prev, toks, start)
                loss = mtp_loss(pl, hl, nxt, self.cfg.loss, self.cfg.top_k).sum() / n
                loss.backward()
                total += float(loss.detach())
                if it == 0:
                    agree += float((hl.argmax(-1) == pl.argmax(-1)).sum())
            if it == 0:
                first_loss = total
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            self.opt.step()
        return first_loss, agree

    def state(self) -> dict[str, torch.Tensor]:
        """The head's tensors to publish with the policy weights (``mtp.*``)."""
        return head_state(self.head)

    # -- in a checkpoint ------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """The head (``MTP_FILE``, beside the policy's HF files: exported with them) and its optimiser
        (``STATE_FILE``, trainer state: not exported) into a checkpoint directory being written."""
        save_head(self.head, directory / MTP_FILE)
        torch.save({"optimizer": self.opt.state_dict(), "steps": self.steps}, directory / STATE_FILE)

    def load(self, directory: Path) -> None:
        """The head and its optimiser from a checkpoint ``save`` wrote (the optimiser starts afresh when
        the directory holds only the head, e.g. an export)."""
        load_head(self.head, directory)
        if (directory / STATE_FILE).is_file():
            state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
            self.opt.load_state_dict(state["optimizer"])
            self.steps = state["steps"]


def make_mtp_trainer(cfg: Config, policy: nn.Module) -> MTPTrainer | None:
    """The run's head trainer when ``train.mtp.enabled`` (None otherwise); it trains the ``mtp`` drafter's
    head, so the engines must draft with it."""
    if not cfg.train.mtp.enabled:
        return None
    spec = cfg.engine.spec
    if not spec.enabled or spec.drafter != "mtp" or cfg.engine.backend != "builtin":
        raise ArborlError("train.mtp.enabled trains the built-in engine's mtp drafter: set engine.spec.enabled=true "
                          "engine.spec.drafter=mtp (engine.backend=builtin), or train.mtp.enabled=false")
    return MTPTrainer(policy, cfg.train.mtp, init_path=mtp_init_path(cfg))


def resumed_config(cfg: Config, checkpoint: Path) -> Config:
    """``cfg`` with the mtp drafter starting from ``checkpoint``'s head when it holds one (the engines
    and the head trainer of a resumed run continue the head trained so far); else ``cfg``."""
    spec = cfg.engine.spec
    if not (spec.enabled and spec.drafter == "mtp" and (checkpoint / MTP_FILE).is_file()):
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(
        update={"spec": spec.model_copy(update={"mtp_path": str(checkpoint / MTP_FILE)})})})
