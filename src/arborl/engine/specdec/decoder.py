"""What the engine holds when speculation is on: the drafter, the adaptive draft length (with the
verify-cost profile) and the metrics. ``drafts`` decides, each decode step, whether to verify drafts
and which; ``verify`` runs the verify forward and the acceptance walk (``verify.accept_all``) and rolls
back the KV of rejected draft tokens; the engine emits the accepted tokens as it emits sampled ones."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from arborl.engine.sequence import Sequence, TokenRows
from arborl.engine.specdec.adaptive import AdaptiveLength, VerifyProfile
from arborl.engine.specdec.draft import Draft
from arborl.engine.specdec.drafter import DRAFTERS, Drafter, EngineView
from arborl.engine.specdec.metrics import SpecMetrics
from arborl.engine.specdec.verify import accept_all
from arborl.types import SamplingParams

PROFILE_CONTEXT = 128  # tokens of context behind the profiled verify forwards


def _grid(limit: int) -> list[int]:
    out, x = [], 1
    while x < limit:
        out.append(x)
        x *= 2
    return out + [limit]


def profile_verify(engine: EngineView, max_positions: int) -> VerifyProfile:
    """Time the verify forward on the engine's own slots (before any request uses them)."""
    runner = engine.runner
    ctx = min(PROFILE_CONTEXT, engine.config.max_seq_len - max_positions - 2)

    def run(b: int, n: int) -> None:
        if n == 0:
            runner.decode([0] * b, [ctx] * b)
        else:
            runner.verify([(s, ctx, [0] * (n + 1), list(range(-1, n))) for s in range(b)])

    return VerifyProfile.measure(run, _grid(engine.config.max_batch_size), [0] + _grid(max_positions))


class SpecDecoder:
    def __init__(self, engine: EngineView, *, drafter: Drafter | None = None, profile: VerifyProfile | None = None) -> None:
        cfg = engine.config.spec
        self.config = cfg
        self.runner = engine.runner
        self.max_seq_len = engine.config.max_seq_len
        self.eos_token_ids = frozenset(engine.eos_token_ids)
        # the runner's verify packs the trees without padding (its attention kernel): cost by actual rows
        self.ragged = bool(getattr(engine.runner, "tree_kernel", False))
        self.drafter = drafter if drafter is not None else DRAFTERS.get(cfg.drafter)(engine)
        self.metrics = SpecMetrics()
        if profile is None and cfg.adaptive:
            path = Path(cfg.profile_path).expanduser() if cfg.profile_path else None
            if path is not None and path.is_file():
                profile = VerifyProfile.load(path)
            else:
                profile = profile_verify(engine, cfg.num_tokens * cfg.num_paths)
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(profile.to_json()))
        self.length = AdaptiveLength(max_k=cfg.num_tokens, prior=cfg.prior_acceptance, profile=profile,
                                     paths=cfg.num_paths, adaptive=cfg.adaptive)
        self.last_k = 0
        self._observed: dict[int, tuple[int, int, int]] = {}  # this step's drafts: (verified k, natural depth, asked k)

    def drafts(self, batch: list[Sequence]) -> list[Draft] | None:
        """The drafts to verify this step, one per sequence of ``batch``; None: decode plainly."""
        for seq in batch:
            self.drafter.sync(seq)
        # would drafting pay if every sequence got a draft? then draft, and decide again on what came
        k = self.last_k = self.length.choose(len(batch))
        if k == 0:
            return self._plain()
        t0 = time.perf_counter()
        drafts = self.drafter.propose(batch, k)
        dt = time.perf_counter() - t0
        self.metrics.draft_s += dt
        self.length.record_draft_time(dt, len(batch))
        out, natural = [], []
        for seq, d in zip(batch, drafts):
            natural.append(d.depth())  # what the drafter had (<= k): positions past it hold nothing at any k
            p = seq.request.params
            depth = min(k, p.max_tokens - len(seq.output) - 1)  # tokens past max_tokens would be dropped
            d = d.truncated(depth).ending_at(self.stop_tokens(p)) if depth > 0 else Draft()
            if len(seq.tokens) + len(d) > self.max_seq_len:
                d = Draft()
            out.append(d)
        drafted = sum(1 for d in out if len(d))
        sizes = [len(d) for d in out] if self.ragged else None
        asked, k = k, self.length.choose(len(batch), drafted / len(batch), sizes) if drafted else 0
        self.last_k = k
        if k == 0:
            return self._plain()
        out = [d.truncated(k) for d in out]
        self._observed = {id(d): (k, depth, asked) for d, depth in zip(out, natural)}
        return out

    def stop_tokens(self, params: SamplingParams) -> frozenset[int]:
        """Tokens that end a sequence with ``params``: drafts stop there (nothing after them is emitted)."""
        stop = frozenset(params.stop_token_ids)
        return stop if params.ignore_eos else stop | self.eos_token_ids

    def _plain(self) -> None:
        self.metrics.plain_steps += 1
        self.length.relax()
        return None

    def observe(self, seqs: list[Sequence], rows: list[torch.Tensor] | torch.Tensor) -> None:
        """After a decode or verify step: ``rows[i]`` [m, hidden] are the policy's hidden rows that produced
        the last m tokens of ``seqs[i]`` (drafters that read hidden states, e.g. ``mtp``, take them)."""
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:
            for seq, r in zip(seqs, rows):
                observe(seq, r)

    def verify(self, batch: list[Sequence], drafts: list[Draft]) -> tuple[list[TokenRows | None], list[torch.Tensor]]:
        """One forward over each sequence's last token and its draft tree, then acceptance. The accepted
        path's KV moves to consecutive positions of the slot; the KV of rejected draft tokens is dropped by
        not counting it (``kv_len``), and later writes overwrite it. Returns each sequence's tokens as
        (token, log-prob, sampling log-prob), None where a log-prob is not finite, and the hidden rows that
        produced them (for ``observe``)."""
        starts = [s.kv_len for s in batch]
        logits = self.runner.verify(
            [(s.slot, s.kv_len, [s.tokens[-1]] + d.tokens, [-1] + [p + 1 for p in d.parents]) for s, d in zip(batch, drafts)]
        )
        hidden = []
        t_walk = time.perf_counter()
        walks = accept_all(logits, drafts, [s.request.params for s in batch], [s.seed for s in batch],
                           [s.next_position for s in batch])
        for r, (seq, d, start, acc) in enumerate(zip(batch, drafts, starts, walks)):
            self.runner.kv.copy_positions(seq.slot, [start + 1 + n for n in acc.nodes],
                                          [start + 1 + j for j in range(len(acc.nodes))])
            seq.kv_len = start + 1 + len(acc.nodes)  # before any release moves slots
            self.accepted(d, len(acc.nodes))
            hidden.append(self.runner.last_hidden[r, [0] + [n + 1 for n in acc.nodes]])
        # the walk's cost per sequence, which the verify profile does not hold
        self.length.record_accept_time(time.perf_counter() - t_walk, len(batch))
        self.metrics.verify_steps += 1
        out = [list(zip(a.tokens, a.logprobs, a.sample_logprobs))
               if all(map(math.isfinite, a.logprobs + a.sample_logprobs)) else None for a in walks]
        return out, hidden

    def accepted(self, draft: Draft, n: int) -> None:
        """``n`` of ``draft``'s tokens were accepted."""
        if len(draft):  # acceptance per draft: sequences without one are accounted for by their share
            self.length.record(n, *self._observed.get(id(draft), (None, None, None)))
            self.metrics.record(len(draft), n)

    def weights_updated(self, head: dict[str, torch.Tensor]) -> None:
        """The policy changed; ``head``: its published ``mtp.*`` tensors, to a drafter that has a head."""
        load = getattr(self.drafter, "load_head", None)
        if load is not None and head:
            load(head)
        self.drafter.weights_updated()

    def stats(self) -> dict:
        d = self.metrics.as_dict()
        d["spec_last_k"] = self.last_k
        return d
