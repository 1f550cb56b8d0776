"""The built-in engine's scheduler: a request's way through the engine -- admission, the waiting queue,
wave selection, aborts, the generated tokens (``emit``: append, stop rules, the request's callback),
slot release, and its result or failure. ``LLMEngine`` keeps the forward steps; it asks this which
sequences run and hands it what they generated (as nano-vllm's ``Scheduler.postprocess``).

Waiting requests form a heap by (-priority, arrival). A *wave* is the set admitted together into free
slots, each with its longest cached prefix copied into its slot; a prompt sharing enough uncached
tokens with one already in the wave waits for the next wave, which then finds that prefix cached (GRPO
groups, shared system prompts). Running sequences sit in ``running`` at the index of their KV slot;
releasing one moves the last into its slot so slots stay dense."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

import torch

from arborl.config import EngineConfig
from arborl.engine.face import StopRules
from arborl.engine.prefix_cache import PrefixKVCache
from arborl.engine.sequence import Sequence, SeqState, TokenRows
from arborl.engine.stats import EngineStats
from arborl.prefix import RadixTree
from arborl.types import FinishReason, GenerateRequest, GenerateResult, InvalidRequestError

_NOT_FINITE = ("its next-token distribution is not finite (NaN / inf logits): no token can be drawn; the "
               "other requests of the step went on")


class Scheduler:
    def __init__(self, config: EngineConfig, kv, prefix_cache: PrefixKVCache, stats: EngineStats,  # noqa: ANN001
                 stop_rules: StopRules, *, seed: int = 0, on_release: Callable[[Sequence], None] | None = None) -> None:
        """``kv``: the runner's KV store (write, read, move by slot); ``on_release(seq)``: told when a sequence
        leaves its slot (the speculative drafter forgets it)."""
        self.config = config
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.stats = stats
        self.stop_rules = stop_rules
        self.on_release = on_release
        self._rng = torch.Generator().manual_seed(seed)
        self._arrivals = 0
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by (-priority, arrival)
        self.running: list[Sequence] = []  # index == slot
        self._by_id: dict[str, Sequence] = {}
        self._aborts: set[str] = set()
        self._failed: list[tuple[str, str]] = []  # (request id, why): requests that failed alone in a step

    # -- requests ---------------------------------------------------------------------------------
    def add(self, request: GenerateRequest, on_token=None) -> Sequence:  # noqa: ANN001
        if request.request_id in self._by_id:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        seq = Sequence(request=request, seed=seed, arrival=self._arrivals, on_token=on_token)
        self._arrivals += 1
        heapq.heappush(self.waiting, (seq.sort_key(), seq))
        self._by_id[request.request_id] = seq
        return seq

    def abort(self, request_id: str) -> None:
        if request_id in self._by_id:
            self._aborts.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def can_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.config.max_batch_size

    def drop_all(self) -> None:
        """Forget every request without serving it (after a failed step; their callers get an error)."""
        if self.on_release is not None:
            for seq in self.running:
                self.on_release(seq)
        self.waiting.clear()
        self.running.clear()
        self._by_id.clear()
        self._aborts.clear()

    # -- the step's choices -----------------------------------------------------------------------
    def apply_aborts(self, finished: list[Sequence]) -> None:
        """End the aborted requests (waiting or running) with what they have: into ``finished``."""
        if not self._aborts:
            return
        ids, self._aborts = self._aborts, set()
        kept = []
        for key, seq in self.waiting:
            if seq.request_id in ids:
                seq.finish_reason = FinishReason.ABORT
                finished.append(seq)
            else:
                kept.append((key, seq))
        if len(kept) != len(self.waiting):
            self.waiting = kept
            heapq.heapify(self.waiting)
        for seq in list(self.running):
            if seq.request_id in ids:
                seq.finish_reason = FinishReason.ABORT
                self.release(seq)
                finished.append(seq)

    def take_wave(self) -> list[Sequence]:
        """Waiting sequences to prefill together, each in a new slot with its cached prefix copied in
        (see the module docstring for the deferral of shared prompts)."""
        # deferring only pays when the first prompt's KV will be in the cache for the others
        min_share = self.config.inbatch_prefix_min_tokens if self.prefix_cache.budget_tokens > 0 else 0
        wave_prompts: RadixTree[None] = RadixTree()
        wave: list[Sequence] = []
        deferred: list[tuple[tuple[int, int], Sequence]] = []
        while self.can_admit():
            key, seq = heapq.heappop(self.waiting)
            prompt = seq.request.prompt_token_ids
            # keep >= 1 prompt token to prefill: its logits give the first generated token
            pieces = self.prefix_cache.lookup(prompt[:-1])
            cached = pieces[-1][0] + pieces[-1][1].shape[3] if pieces else 0
            if min_share and wave and wave_prompts.match_prefix(prompt[:-1]).length - cached >= min_share:
                deferred.append((key, seq))
                continue
            wave_prompts.insert(prompt)
            seq.scheduled_at = time.perf_counter()
            seq.slot = len(self.running)
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            for pos, kv in pieces:
                self.kv.write(seq.slot, pos, kv)
            seq.kv_len = seq.cached_prompt_tokens = cached
            self.stats.prompt_tokens += len(prompt)
            self.stats.cached_prompt_tokens += cached
            wave.append(seq)
        for item in deferred:
            heapq.heappush(self.waiting, item)
        return wave

    def release(self, seq: Sequence, *, cache: bool = True) -> None:
        """Take ``seq`` out of the running batch, cache its KV (unless ``cache`` is False: a failed
        sequence's KV may be what went wrong), compact the slots."""
        if cache and seq.kv_len > 0:
            self.prefix_cache.insert(seq.tokens[: seq.kv_len], lambda a, b, s=seq.slot: self.kv.read(s, a, b))
        last = self.running.pop()
        if last is not seq:
            self.kv.move(last.slot, seq.slot, last.kv_len)
            last.slot = seq.slot
            self.running[seq.slot] = last
        seq.slot = -1
        seq.state = SeqState.FINISHED
        if self.on_release is not None:
            self.on_release(seq)

    # -- what the sequences generated, and how they leave -------------------------------------------
    def emit(self, seqs: list[Sequence], new: list[TokenRows | None], version: int, finished: list[Sequence]) -> None:
        """The one path of every generated token, sampled or verified: append ``new[i]``'s tokens to
        ``seqs[i]`` one by one (stamped ``version``), apply the stop rules and the request's callback after
        each. A sequence leaves the batch when it finishes (into ``finished``), or fails alone: its logits
        were not finite (``new[i]`` None), or its own stop rule or callback raised."""
        for seq, rows in zip(seqs, new):
            if rows is None:
                self.fail(seq, _NOT_FINITE)
                continue
            for tok, logprob, sample_logprob in rows:
                seq.kv_len = len(seq.tokens)  # the KV of every token before the one appended now
                seq.append(tok, logprob, sample_logprob, version)
                self.stats.generated_tokens += 1
                try:
                    reason = self.stop_rules.reason(seq.request, seq.output, tok)
                    if seq.on_token is not None:
                        seq.on_token(seq)
                except Exception as e:  # noqa: BLE001 - the request's own failure, reported to its caller
                    self.fail(seq, f"its stop rule or token callback raised {e!r}")
                    break
                if reason is not None:
                    seq.finish_reason = reason
                    self.release(seq)
                    finished.append(seq)
                    break

    def fail(self, seq: Sequence, why: str) -> None:
        """Take ``seq`` out of the engine alone; its KV is not cached (it may be what went wrong)."""
        if seq.slot >= 0:
            self.release(seq, cache=False)
        self._by_id.pop(seq.request_id, None)
        self._failed.append((seq.request_id, f"request {seq.request_id} failed at token {len(seq.output)}: {why}"))

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self._failed = self._failed, []
        return failed

    def finish(self, seq: Sequence) -> GenerateResult:
        """``seq`` (out of ``finished``) leaves the engine: its result."""
        seq.finished_at = time.perf_counter()
        seq.state = SeqState.FINISHED
        self._by_id.pop(seq.request_id, None)
        self.stats.finished += 1
        if seq.finish_reason == FinishReason.ABORT:
            self.stats.aborted += 1
        return seq.result(self.config.engine_id)
