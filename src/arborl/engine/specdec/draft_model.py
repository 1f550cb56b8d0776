"""Drafts from a smaller model (I1) of the same tokenizer: a separate Hugging Face checkpoint
(``engine.spec.draft_model_path``, e.g. a 135M for a 1.7B of its family; its weights stay as loaded),
else the policy's first ``draft_layers`` decoder layers with its embeddings, final norm and LM head
(shared, not copied: a weight update reaches the drafter at once); run by the engine's own forward
(``ModelRunner``) over a KV cache of its own.

Drafts are greedy (q one-hot), so verification is ordinary rejection sampling. Each sequence keeps a
draft slot; its KV stays valid for the tokens the policy accepted, the rest is recomputed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from arborl.engine.model_runner import ModelRunner
from arborl.engine.sequence import Sequence
from arborl.engine.specdec.draft import Draft
from arborl.engine.specdec.drafter import DRAFTERS, EngineView
from arborl.models.hf_dir import has_tokenizer
from arborl.types import ArborlError


class DraftModelError(ArborlError):
    """engine.spec.draft_model_path cannot draft for this policy (no model there, another vocabulary or tokenizer)."""


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


def load_draft_model(path: str | Path, policy: nn.Module, tokenizer: Any = None) -> nn.Module:
    """The HF checkpoint at ``path`` as a drafter for ``policy`` (its device and float dtype): the same
    vocabulary size, and when both have a tokenizer, the same token -> id map; DraftModelError if not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise DraftModelError(f"engine.spec.draft_model_path: {path} is not a Hugging Face model directory "
                              "(no config.json); point it at one, e.g. an `arborl export` or a downloaded model")
    want = policy.config.vocab_size
    if tokenizer is not None and has_tokenizer(path):
        theirs, ours = AutoTokenizer.from_pretrained(str(path)).get_vocab(), tokenizer.get_vocab()
        if theirs != ours:
            diff = sum(theirs.get(t) != ours.get(t) for t in theirs.keys() | ours.keys())
            raise DraftModelError(f"engine.spec.draft_model_path: {path}'s tokenizer is not the policy's ({diff} "
                                  "tokens have another id or none); the draft model must share the policy's tokenizer")
    param = next(policy.parameters())
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype).to(param.device).eval()
    if model.config.vocab_size != want:
        raise DraftModelError(f"engine.spec.draft_model_path: {path} has a vocabulary of {model.config.vocab_size} "
                              f"tokens, the policy {want}; the draft model must share the policy's tokenizer")
    return model


class DraftModelDrafter:
    def __init__(self, engine: EngineView) -> None:
        cfg = engine.config
        path = cfg.spec.draft_model_path
        self.shared = path is None  # the policy's own layers: a weight update changes the drafter too
        self.model = (TruncatedLM(engine.model, cfg.spec.draft_layers) if self.shared
                      else load_draft_model(path, engine.model, getattr(engine, "tokenizer", None))).eval()
        # the engine's own fast CPU path (prepacked weights, the row kernel): drafting runs k forwards per step
        self.runner = ModelRunner(self.model, slots=cfg.max_batch_size, max_len=cfg.max_seq_len, attention=cfg.attention,
                                  packed=cfg.cpu_packed_weights, row_kernel_max_rows=cfg.cpu_row_kernel_max_rows)
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
        if not self.shared:  # a separate checkpoint: its weights and KV stay as they are
            return
        if self.runner.linear is not None:  # the policy's own layers, updated in place: pack them again
            self.runner.linear.refresh()
        for rid in self._valid:  # their KV was computed under the old weights
            self._valid[rid] = 0
        self._proposed.clear()


@DRAFTERS.register("draft_model")
def make_draft_model_drafter(engine: EngineView) -> DraftModelDrafter:
    return DraftModelDrafter(engine)
