"""The engine loop (synchronous core): admit, prefill with prefix reuse, decode the running batch.

Continuous batching: every ``step()`` admits waiting requests into free slots (which ones: the
scheduler, ``engine/scheduler.py``), prefills them -- skipping the longest prefix whose KV is cached --
and then decodes one token for every running sequence. Every generated token, sampled or verified,
takes one path (``_emit``: append, stop rules, the request's callback). Finished sequences leave at once
and their KV goes to the prefix cache; a request whose own step fails (non-finite logits, a raising stop
rule or callback) leaves alone. ``update_weights`` swaps the policy between steps; sequences in flight continue, their KV is
recomputed under the new weights, and every token is stamped with the version that produced it.

With ``engine.spec.enabled`` a decode step may instead verify drafts (``engine/specdec``): one forward
over every sequence's last token and its draft tree, then lossless acceptance; the KV of rejected
draft tokens is dropped by not counting it (``kv_len``), and later writes overwrite it.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from arborl.config import EngineConfig
from arborl.engine.face import EngineLimits, StopRules
from arborl.engine.model_runner import ModelRunner
from arborl.engine.prefix_cache import PrefixKVCache
from arborl.engine.sampling import sample
from arborl.engine.scheduler import Scheduler
from arborl.engine.sequence import Sequence, SeqState
from arborl.engine.stats import EngineStats
from arborl.engine.specdec import Draft, SpecDecoder
from arborl.engine.specdec.verify import accept_all
from arborl.heap import release_free_memory
from arborl.types import FinishReason, GenerateRequest, GenerateResult

_NOT_FINITE = ("its next-token distribution is not finite (NaN / inf logits): no token can be drawn; the "
               "other requests of the step went on")


class LLMEngine:
    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        *,
        eos_token_ids: list[int],
        tokenizer=None,
        seed: int = 0,
        version: int = 0,
        owns_model: bool = False,
    ) -> None:
        """``owns_model``: nobody else reads ``model`` -- the engine frees the Linear weights its packed copies
        replace (one copy of them in the engine, not two or three)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.engine_id = config.engine_id
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.version = version
        self.runner = ModelRunner(
            model, slots=config.max_batch_size, max_len=config.max_seq_len, packed=config.cpu_packed_weights,
            row_kernel_max_rows=config.cpu_row_kernel_max_rows, attention=config.attention,
        )
        self.limits = EngineLimits(config.max_seq_len, config.max_batch_size, int(self.runner.vocab_size),
                                   frozenset(self.eos_token_ids))
        decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self.stop_rules = StopRules(self.limits.eos_token_ids, config.max_seq_len, decode)
        self.prefix_cache = PrefixKVCache(config.prefix_cache_tokens if config.prefix_cache else 0)
        self._failed: list[tuple[str, str]] = []  # (request id, why): requests that failed alone in a step
        self.stats = EngineStats()
        self.spec = SpecDecoder(self) if config.spec.enabled else None
        self.sched = Scheduler(config, self.runner.kv, self.prefix_cache, self.stats, seed=seed,
                               on_release=self.spec.drafter.release if self.spec is not None else None)
        if owns_model and self.spec is None:  # a drafter may run the policy's modules (draft_layers): kept then
            self.runner.release_module_weights()
            release_free_memory()

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest, on_token=None) -> Sequence:
        self.limits.check(request, can_decode=self.tokenizer is not None)
        return self.sched.add(request, on_token)

    def abort(self, request_id: str) -> None:
        """Finish the request at the next step with what it has so far (finish_reason "abort")."""
        self.sched.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.sched.has_work

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    # -- weights ----------------------------------------------------------------------------------
    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Load new weights (between steps). Returns the seconds it took, KV recompute included."""
        t0 = time.perf_counter()
        head = {k: state[k] for k in state if k.startswith("mtp.")}  # the mtp drafter's head, published with the policy
        if head:
            state = {k: v for k, v in state.items() if k not in head}
        self.runner.load_weights(state)
        release_free_memory()  # the old packed weights
        if head and self.spec is not None:
            self.spec.update_head(head)
        self.version = version
        self.prefix_cache.clear()  # cached KV belongs to the old policy
        if self.spec is not None:
            self.spec.drafter.weights_updated()
        if self.sched.running:
            with torch.inference_mode():
                self._prefill([(seq, seq.tokens[: seq.kv_len], 0) for seq in self.sched.running])
        self.stats.weight_updates += 1
        return time.perf_counter() - t0

    def release_memory(self) -> int:
        """Free the prefix cache and the KV rows beyond the first allocation when nothing runs or waits (see
        ``EngineFace.release_memory``); the next requests grow them again. Returns the bytes freed."""
        if self.has_work:
            return 0
        freed = self.prefix_cache.nbytes()
        self.prefix_cache.clear()
        freed += self.runner.kv.shrink()
        release_free_memory()
        return freed

    # -- KV migration (divided rollout) ------------------------------------------------------------
    def export_prefix_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]:
        """The KV of the longest cached prefix of ``tokens`` (``[layers, 2, kv_heads, n, head_dim]``,
        None when nothing is cached) and the policy version it belongs to."""
        pieces = self.prefix_cache.lookup(tokens)
        kv = torch.cat([p for _, p in pieces], dim=3) if pieces else None
        return kv, self.version

    def import_prefix_kv(self, tokens: list[int], kv: torch.Tensor, version: int) -> int:
        """Cache ``kv`` (exported by another engine) as the KV of ``tokens[:n]``; returns n, or 0 when it
        belongs to another policy version than this engine's."""
        if version != self.version or kv is None or self.prefix_cache.budget_tokens <= 0:
            return 0
        n = min(kv.shape[3], len(tokens))
        kv = kv.to(self.runner.device)
        self.prefix_cache.insert(tokens[:n], lambda a, b: kv[:, :, :, a:b].clone())
        return sum(p.shape[3] for _, p in self.prefix_cache.lookup(tokens[:n]))  # what the cache kept

    # -- the loop ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerateResult]:
        t0 = time.perf_counter()
        finished: list[Sequence] = []
        self.sched.apply_aborts(finished)
        self._admit(finished)
        if self.sched.running:
            self._decode(finished)
        results = [self._finish(seq) for seq in finished]
        self.stats.steps += 1
        self.stats.busy_s += time.perf_counter() - t0
        return results

    def take_failed(self) -> list[tuple[str, str]]:
        """The requests that failed alone since the last call, with the reason; the others of their step
        went on. Their callers get an error (``RequestFailedError``), not a result."""
        failed, self._failed = self._failed, []
        return failed

    def reap_aborts(self) -> list[GenerateResult]:
        """End the aborted requests now, without a decode step (a paused engine still answers aborts)."""
        finished: list[Sequence] = []
        self.sched.apply_aborts(finished)
        return [self._finish(seq) for seq in finished]

    def run_until_done(self) -> list[GenerateResult]:
        out: list[GenerateResult] = []
        while self.has_work:
            out.extend(self.step())
        return out

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Blocking convenience: serve ``requests`` to completion, results in request order."""
        for r in requests:
            self.add_request(r)
        done = {res.request_id: res for res in self.run_until_done()}
        return [done[r.request_id] for r in requests]

    def drop_all(self) -> None:
        """Forget every request without serving it (after a failed step; their callers get an error)."""
        self.sched.drop_all()

    def _admit(self, finished: list[Sequence]) -> None:
        while self.sched.can_admit():
            wave = self.sched.take_wave()
            jobs = [(seq, seq.request.prompt_token_ids[seq.kv_len :], seq.kv_len) for seq in wave]
            logits = self._prefill(jobs)
            for seq in wave:
                self.prefix_cache.insert(
                    seq.request.prompt_token_ids, lambda a, b, s=seq.slot: self.runner.kv.read(s, a, b)
                )
            self._sample_into(wave, logits, finished)

    def _prefill(self, jobs: list[tuple[Sequence, list[int], int]]) -> torch.Tensor:
        """Run each job's tokens (from position ``start`` of its slot), packing several sequences per
        forward and splitting long ones so no forward exceeds ``prefill_chunk_tokens``.
        Returns the logits after each job's last token, in job order."""
        budget = self.config.prefill_chunk_tokens
        out: list[torch.Tensor | None] = [None] * len(jobs)
        pending = [(i, seq, toks, start) for i, (seq, toks, start) in enumerate(jobs)]
        while pending:
            items, rows, rest, used = [], [], [], 0
            for i, seq, toks, start in pending:
                take = min(len(toks), budget - used)
                if take <= 0:
                    rest.append((i, seq, toks, start))
                    continue
                items.append((seq.slot, toks[:take], start))
                rows.append(i if take == len(toks) else -1)
                if take < len(toks):
                    rest.append((i, seq, toks[take:], start + take))
                used += take
            logits = self.runner.prefill(items)
            for row, i in enumerate(rows):
                if i >= 0:
                    out[i] = logits[row]
            pending = rest
        for seq, toks, start in jobs:
            seq.kv_len = start + len(toks)
            self.stats.prefill_tokens += len(toks)
        return torch.stack(out)  # type: ignore[arg-type]

    def _decode(self, finished: list[Sequence]) -> None:
        batch = list(self.sched.running)
        if self.spec is not None:
            drafts = self.spec.drafts(batch)
            if drafts is not None:
                self._verify(batch, drafts, finished)
                return
        logits = self.runner.decode([s.tokens[-1] for s in batch], [s.kv_len for s in batch])
        for s in batch:
            s.kv_len += 1
        self.stats.decode_step(len(batch))
        self._sample_into(batch, logits, finished)
        if self.spec is not None:
            self.spec.observe(batch, self.runner.last_hidden[:, None])

    def _verify(self, batch: list[Sequence], drafts: list[Draft], finished: list[Sequence]) -> None:
        """One forward over each sequence's last token + draft tree; accept, emit, roll back the rest."""
        assert self.spec is not None
        starts = [s.kv_len for s in batch]
        logits = self.runner.verify(
            [(s.slot, s.kv_len, [s.tokens[-1]] + d.tokens, [-1] + [p + 1 for p in d.parents]) for s, d in zip(batch, drafts)]
        )
        results, hidden = [], []
        t_walk = time.perf_counter()
        walks = accept_all(logits, drafts, [s.request.params for s in batch], [s.seed for s in batch],
                           [s.next_position for s in batch])
        for r, (seq, d, start, acc) in enumerate(zip(batch, drafts, starts, walks)):
            # the accepted path's KV moves to consecutive positions; anything past it is rolled back
            self.runner.kv.copy_positions(seq.slot, [start + 1 + n for n in acc.nodes],
                                          [start + 1 + j for j in range(len(acc.nodes))])
            seq.kv_len = start + 1 + len(acc.nodes)  # before any release moves slots
            self.spec.accepted(d, len(acc.nodes))
            results.append(acc)
            hidden.append(self.runner.last_hidden[r, [0] + [n + 1 for n in acc.nodes]])
        self.spec.walked(time.perf_counter() - t_walk, len(batch))
        self.stats.decode_step(len(batch))
        self.spec.metrics.verify_steps += 1
        for seq, acc in zip(batch, results):
            if not all(map(math.isfinite, acc.logprobs + acc.sample_logprobs)):
                self._fail(seq, _NOT_FINITE)
                continue
            for tok, lp, slp in zip(acc.tokens, acc.logprobs, acc.sample_logprobs):
                seq.kv_len = len(seq.tokens)  # the KV of every token before the one appended now
                if self._emit(seq, tok, lp, slp, finished):
                    break
        self.spec.observe(batch, hidden)

    def _sample_into(self, seqs: list[Sequence], logits: torch.Tensor, finished: list[Sequence]) -> None:
        out = sample(logits, [s.request.params for s in seqs], [s.seed for s in seqs], [s.next_position for s in seqs])
        failed = set(out.failed)
        for i, seq in enumerate(seqs):
            if i in failed:
                self._fail(seq, _NOT_FINITE)
            else:
                self._emit(seq, out.tokens[i], out.logprobs[i], out.sample_logprobs[i], finished)

    def _emit(self, seq: Sequence, tok: int, logprob: float, sample_logprob: float, finished: list[Sequence]) -> bool:
        """Append one generated token, apply the stop rules and the request's callback; True when the
        sequence left the batch (finished, or failed: an error in its own stop rule or callback fails it
        alone)."""
        seq.append(tok, logprob, sample_logprob, self.version)
        self.stats.generated_tokens += 1
        try:
            reason = self.stop_rules.reason(seq.request, seq.output, tok)
            if seq.on_token is not None:
                seq.on_token(seq)
        except Exception as e:  # noqa: BLE001 - the request's own failure, reported to its caller
            self._fail(seq, f"its stop rule or token callback raised {e!r}")
            return True
        if reason is None:
            return False
        seq.finish_reason = reason
        self.sched.release(seq)
        finished.append(seq)
        return True

    def _fail(self, seq: Sequence, why: str) -> None:
        """Take ``seq`` out of the engine alone; its KV is not cached (it may be what went wrong)."""
        if seq.slot >= 0:
            self.sched.release(seq, cache=False)
        self.sched.forget(seq.request_id)
        self._failed.append((seq.request_id, f"request {seq.request_id} failed at token {len(seq.output)}: {why}"))

    def _finish(self, seq: Sequence) -> GenerateResult:
        seq.finished_at = time.perf_counter()
        seq.state = SeqState.FINISHED
        self.sched.forget(seq.request_id)
        self.stats.finished += 1
        if seq.finish_reason == FinishReason.ABORT:
            self.stats.aborted += 1
        return seq.result(self.engine_id)

    def spec_stats(self) -> dict:
        """Speculative-decoding counters (vLLM's names); empty when speculation is off."""
        return self.spec.stats() if self.spec is not None else {}

    def stats_dict(self) -> dict:
        d = self.stats.as_dict(
            waiting=len(self.sched.waiting), running=len(self.sched.running), cached_tokens=self.prefix_cache.cached_tokens
        )
        if self.spec is not None:
            d.update(self.spec.stats())
        return d
