"""Drafts from a smaller model (I1) of the same tokenizer: the policy's first ``draft_layers`` decoder
layers with its embeddings, final norm and LM head (shared, not copied: a weight update reaches the
drafter at once), run by the engine's own forward (``ModelRunner``) over a KV cache of its own.

Drafts are greedy (q one-hot), so verification is ordinary rejection sampling. Each sequence keeps a
draft slot; its KV stays valid for the tokens the policy accepted, the rest is recomputed.
"""

from __future__ import annotations

import torch
from torch import nn

from arborl.engine.model_runner import ModelRunner
from arborl.engine.sequence import Sequence
from arborl.engine.spec.draft import Draft
from arborl.engine.spec.drafter import DRAFTERS, EngineView
from arborl.types import ArborlError


class _Decoder(nn.Module):
    def __init__(self, base: nn.Module, layers: int) -> None:
        super().__init__()
        self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleList(list(base.layers)[:layers])
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb


class TruncatedLM(nn.Module):
    """The first ``layers`` decoder layers of ``policy`` under its own LM head (weights shared)."""

    def __init__(self, policy: nn.Module, layers: int) -> None:
        super().__init__()
        total = len(policy.model.layers)
        if not 1 <= layers <= total:
            raise ArborlError(f"engine.spec.draft_layers must be in [1, {total}] (the policy's layers), got {layers}")
        self.model = _Decoder(policy.model, layers)
        self.lm_head = policy.lm_head
        self.config = policy.config

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens


class DraftModelDrafter:
    def __init__(self, engine: EngineView) -> None:
        cfg = engine.config
        self.model = TruncatedLM(engine.model, cfg.spec.draft_layers).eval()
        self.runner = ModelRunner(self.model, slots=cfg.max_batch_size, max_len=cfg.max_seq_len, attention=cfg.attention)
        self._free = list(range(cfg.max_batch_size - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._valid: dict[str, int] = {}  # tokens of the sequence whose draft KV is valid
        self._proposed: dict[str, tuple[int, list[int]]] = {}  # context length, tokens fed while drafting

    def sync(self, seq: Sequence) -> None:
        rid = seq.request_id
        if rid not in self._slot:
            self._slot[rid] = self._free.pop()
            self._valid[rid] = 0
        if rid in self._proposed:  # keep the KV of the fed draft tokens the policy accepted
            n, fed = self._proposed.pop(rid)
            toks = seq.tokens
            ok = 0
            while ok < len(fed) and n + ok < len(toks) and toks[n + ok] == fed[ok]:
                ok += 1
            self._valid[rid] = n + ok

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[Draft]:
        k = min(k, self.runner.kv.max_len - max(len(s.tokens) for s in seqs))
        if not seqs or k <= 0:
            return [Draft() for _ in seqs]
        items = []
        for s in seqs:
            rid, toks = s.request_id, s.tokens
            start = min(self._valid[rid], len(toks) - 1)
            items.append((self._slot[rid], toks[start:], start))
        logits = self.runner.prefill(items)  # catch up: the tokens after the valid KV, last one included
        drafted = [[int(t)] for t in logits.argmax(-1).tolist()]
        for s in seqs:
            self._valid[s.request_id] = len(s.tokens)
        for _ in range(k - 1):
            logits = self.runner.verify([(self._slot[s.request_id], len(s.tokens) + len(d) - 1, [d[-1]], [-1])
                                         for s, d in zip(seqs, drafted)])
            for d, t in zip(drafted, logits[:, 0].argmax(-1).tolist()):
                d.append(int(t))
        for s, d in zip(seqs, drafted):
            self._proposed[s.request_id] = (len(s.tokens), d[:-1])  # d[:-1] had their KV written
        return [Draft.chain(d) for d in drafted]

    def release(self, seq: Sequence) -> None:
        rid = seq.request_id
        if rid in self._slot:
            self._free.append(self._slot.pop(rid))
        self._valid.pop(rid, None)
        self._proposed.pop(rid, None)

    def weights_updated(self) -> None:
        for rid in self._valid:  # the layers are the policy's own: their new weights are already in
            self._valid[rid] = 0
        self._proposed.clear()


@DRAFTERS.register("draft_model")
def make_draft_model_drafter(engine: EngineView) -> DraftModelDrafter:
    return DraftModelDrafter(engine)
