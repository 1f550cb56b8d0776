"""The engine loop (synchronous core): admit, prefill with prefix reuse, decode the running batch.

Continuous batching: every ``step()`` admits waiting requests into free slots (which ones: the
scheduler, ``engine/scheduler.py``), prefills them (``engine/chunked_prefill.py``) -- skipping the
longest prefix whose KV is cached -- and then decodes one token for every running sequence. Every
generated token, sampled or verified, takes one path (``Scheduler.emit``: append, stop rules, the
request's callback). Finished sequences leave at once and their KV goes to the prefix cache; a request
whose own step fails (non-finite logits, a raising stop rule or callback) leaves alone.
``update_weights`` swaps the policy between steps; sequences in flight continue, their KV is
recomputed under the new weights, and every token is stamped with the version that produced it.

With ``engine.spec.enabled`` a decode step may instead verify drafts (``SpecDecoder.verify``): one
forward over every sequence's last token and its draft tree, then lossless acceptance.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from arborl.config import EngineConfig
from arborl.engine.chunked_prefill import prefill_chunked
from arborl.engine.face import EngineLimits, StopRules, WeightsReleasedError
from arborl.engine.model_runner import ModelRunner
from arborl.engine.prefix_cache import PrefixKVCache
from arborl.engine.sampling import sample
from arborl.engine.scheduler import Scheduler
from arborl.engine.sequence import Sequence, TokenRows
from arborl.engine.stats import EngineStats
from arborl.engine.specdec import SpecDecoder
from arborl.heap import release_free_memory
from arborl.types import GenerateRequest, GenerateResult


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
        self.stats = EngineStats()
        self.spec = SpecDecoder(self) if config.spec.enabled else None
        self.sched = Scheduler(config, self.runner.kv, self.prefix_cache, self.stats, self.stop_rules, seed=seed,
                               on_release=self.spec.drafter.release if self.spec is not None else None)
        if owns_model and self.spec is None:  # a drafter may run the policy's modules (draft_layers): kept then
            self.runner.release_module_weights()
            release_free_memory()

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest, on_token=None) -> Sequence:
        if self.runner.weights_released:
            raise WeightsReleasedError("this engine released its weights; it serves again after the next weight update")
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
        head = {k: v for k, v in state.items() if k.startswith("mtp.")}  # the mtp drafter's, published with the policy
        self.runner.load_weights({k: v for k, v in state.items() if k not in head} if head else state)
        release_free_memory()  # the old packed weights
        self.version = version
        self.prefix_cache.clear()  # cached KV belongs to the old policy
        if self.spec is not None:
            self.spec.weights_updated(head)
        if self.sched.running:
            with torch.inference_mode():
                prefill_chunked(self.runner, [(seq, seq.tokens[: seq.kv_len], 0) for seq in self.sched.running],
                                self.config.prefill_chunk_tokens, self.stats)
        self.stats.weight_updates += 1
        return time.perf_counter() - t0

    def release_memory(self, weights: bool = False) -> int:
        """Free the prefix cache and the KV rows beyond the first allocation when nothing runs or waits (see
        ``EngineFace.release_memory``); the next requests grow them again. ``weights``: the packed Linear
        weights too, for a next update that carries every weight; no request is served until it comes.
        Returns the bytes freed."""
        if self.has_work:
            return 0
        freed = self.prefix_cache.nbytes()
        self.prefix_cache.clear()
        freed += self.runner.kv.shrink()
        if weights:
            freed += self.runner.release_weights()
        release_free_memory()
        return freed

    # -- KV migration (divided rollout) ------------------------------------------------------------
    def export_prefix_kv(self, tokens: list[int]) -> tuple[torch.Tensor | None, int]:
        """The KV of the longest cached prefix of ``tokens`` (``[layers, 2, kv_heads, n, head_dim]``,
        None when nothing is cached) and the policy version it belongs to."""
        return self.prefix_cache.prefix_kv(tokens), self.version

    def import_prefix_kv(self, tokens: list[int], kv: torch.Tensor, version: int) -> int:
        """Cache ``kv`` (exported by another engine) as the KV of ``tokens[:n]``; returns n, or 0 when it
        belongs to another policy version than this engine's."""
        if version != self.version or kv is None or self.prefix_cache.budget_tokens <= 0:
            return 0
        return self.prefix_cache.insert_kv(tokens, kv.to(self.runner.device))

    # -- the loop ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[GenerateResult]:
        t0 = time.perf_counter()
        finished: list[Sequence] = []
        self.sched.apply_aborts(finished)
        self._admit(finished)
        if self.sched.running:
            self._decode(finished)
        results = [self.sched.finish(seq) for seq in finished]
        self.stats.steps += 1
        self.stats.busy_s += time.perf_counter() - t0
        return results

    def take_failed(self) -> list[tuple[str, str]]:
        """The requests that failed alone since the last call, with the reason; the others of their step
        went on. Their callers get an error (``RequestFailedError``), not a result."""
        return self.sched.take_failed()

    def reap_aborts(self) -> list[GenerateResult]:
        """End the aborted requests now, without a decode step (a paused engine still answers aborts)."""
        finished: list[Sequence] = []
        self.sched.apply_aborts(finished)
        return [self.sched.finish(seq) for seq in finished]

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
            logits = prefill_chunked(self.runner, jobs, self.config.prefill_chunk_tokens, self.stats)
            for seq in wave:
                self.prefix_cache.insert(
                    seq.request.prompt_token_ids, lambda a, b, s=seq.slot: self.runner.kv.read(s, a, b)
                )
            self.sched.emit(wave, self._sample(wave, logits), self.version, finished)

    def _decode(self, finished: list[Sequence]) -> None:
        """One token for every running sequence, or the accepted part of its draft (a verify step)."""
        batch = list(self.sched.running)
        drafts = self.spec.drafts(batch) if self.spec is not None else None
        if drafts is None:
            logits = self.runner.decode([s.tokens[-1] for s in batch], [s.kv_len for s in batch])
            for s in batch:
                s.kv_len += 1
            new, hidden = self._sample(batch, logits), self.runner.last_hidden[:, None]
        else:
            new, hidden = self.spec.verify(batch, drafts)
        self.stats.decode_step(len(batch))
        self.sched.emit(batch, new, self.version, finished)
        if self.spec is not None:
            self.spec.observe(batch, hidden)

    @staticmethod
    def _sample(seqs: list[Sequence], logits: torch.Tensor) -> list[TokenRows | None]:
        out = sample(logits, [s.request.params for s in seqs], [s.seed for s in seqs], [s.next_position for s in seqs])
        failed = set(out.failed)
        return [None if i in failed else [(out.tokens[i], out.logprobs[i], out.sample_logprobs[i])]
                for i in range(len(seqs))]

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
