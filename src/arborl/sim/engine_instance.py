"""A real built-in engine behind the driver's ``Instance`` interface.

Every ``run_next`` runs one real ``LLMEngine.step()`` and advances this instance's clock by the
step's measured duration, so several instances stepped in turn on one machine behave like
instances on separate machines (each clock only counts its own compute; the driver always steps
the instance whose clock is earliest). Lengths are forced: a request generates exactly the tokens
the workload planned (``ignore_eos``), in assignments of at most ``stop_after`` tokens; the
continuation of a divided request is its prompt + everything generated so far, so on the same
instance its prefix is a radix-cache hit, and elsewhere it is recomputed (``migration=recompute``)
or its KV is copied from the instance that holds it into this one's prefix cache (``transfer``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from arborl.engine import LLMEngine
from arborl.sim.instance import Admit, ChunkEnd
from arborl.types import FinishReason, GenerateRequest, SamplingParams


class TokenStore:
    """Token ids of every lineage (episode): a deterministic random prompt, then what was generated."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.seed = seed
        self.ids: dict[str, list[int]] = {}

    def context(self, lineage: str, length: int) -> list[int]:
        ids = self.ids.get(lineage)
        if ids is None:
            ids = self.ids[lineage] = self._random(lineage, length)
        elif len(ids) < length:  # observation tokens of a new turn
            ids.extend(self._random(f"{lineage}#{len(ids)}", length - len(ids)))
        return ids[:length]

    def extend(self, lineage: str, tokens: list[int]) -> None:
        self.ids.setdefault(lineage, []).extend(tokens)

    def _random(self, key: str, n: int) -> list[int]:
        import zlib

        rng = np.random.default_rng([self.seed, zlib.crc32(key.encode())])
        return rng.integers(0, self.vocab - 1, n).tolist()


def transfer_kv(src: LLMEngine, dst: LLMEngine, tokens: list[int]) -> int:
    """Copy the KV of the longest cached prefix of ``tokens`` from ``src``'s prefix cache into
    ``dst``'s; returns the tokens copied."""
    kv, version = src.export_prefix_kv(tokens)
    return dst.import_prefix_kv(tokens, kv, version) if kv is not None else 0


class EngineInstance:
    def __init__(self, index: int, engine: LLMEngine, store: TokenStore, *, migration: str = "recompute",
                 peers: list["EngineInstance"] | None = None, temperature: float = 1.0) -> None:
        self.index = index
        self.engine = engine
        self.store = store
        self.migration = migration
        self.peers = peers if peers is not None else []
        self.temperature = temperature
        self.clock = 0.0
        self.version = engine.version
        self._admits: dict[str, tuple[Admit, object]] = {}  # engine request id -> (admit, sequence)
        self._ignored: set[str] = set()
        self._n = 0
        self.busy_s = 0.0
        self.steps = 0
        self.batch_steps = 0
        self.transfer_s = 0.0
        self.transfer_tokens = 0
        self.update_s = 0.0

    @property
    def max_batch(self) -> int:
        return self.engine.config.max_batch_size

    def has_room(self) -> bool:
        return self.engine.num_running + self.engine.num_waiting < self.max_batch

    def load(self) -> float:
        return (self.engine.num_running + self.engine.num_waiting) / self.max_batch

    def admit(self, a: Admit, now: float) -> None:
        self.clock = max(self.clock, now)
        ids = self.store.context(a.lineage, a.context)
        if self.migration == "transfer" and a.home is not None and a.home != self.index and self.peers:
            t0 = time.perf_counter()
            n = transfer_kv(self.peers[a.home].engine, self.engine, ids[:-1])
            dt = time.perf_counter() - t0
            self.clock += dt
            self.transfer_s += dt
            self.transfer_tokens += n
        self._n += 1
        rid = f"{a.request_id}@{self._n}"
        params = SamplingParams(temperature=self.temperature, max_tokens=a.stop_after, ignore_eos=True, seed=a.seed + self._n)
        seq = self.engine.add_request(GenerateRequest(list(ids), params, request_id=rid, priority=a.priority))
        self._admits[rid] = (a, seq)

    def next_event_time(self) -> float:
        return self.clock if self.engine.has_work else math.inf

    def run_next(self) -> list[ChunkEnd]:
        if not self.engine.has_work:
            return []
        t0 = time.perf_counter()
        batch = self.engine.num_running + self.engine.num_waiting
        results = self.engine.step()
        dt = time.perf_counter() - t0
        self.clock += dt
        self.busy_s += dt
        self.steps += 1
        self.batch_steps += min(batch, self.max_batch)
        ends = []
        for res in results:
            entry = self._admits.pop(res.request_id, None)
            if entry is None or res.request_id in self._ignored or res.finish_reason == FinishReason.ABORT:
                self._ignored.discard(res.request_id)
                continue
            a, _ = entry
            self.store.extend(a.lineage, res.token_ids)
            vs = res.versions or [self.version]
            ends.append(ChunkEnd(a.request_id, len(res.token_ids), self.clock, min(vs), max(vs)))
        return ends

    def sync_to(self, t: float) -> list[ChunkEnd]:
        if not self.engine.has_work:
            self.clock = max(self.clock, t)
        return []  # a step in progress is never split

    def abort(self, request_id: str) -> int:
        for rid, (a, seq) in list(self._admits.items()):
            if a.request_id == request_id:
                out = list(seq.output)
                self.engine.abort(rid)
                self._ignored.add(rid)
                self.store.extend(a.lineage, out)  # kept for an abort-and-resume continuation
                return len(out)
        return 0

    def update_weights(self, version: int, now: float, state: dict | None = None) -> None:
        self.clock = max(self.clock, now)
        t0 = time.perf_counter()
        st = state if state is not None else {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}
        self.engine.update_weights(st, version)
        dt = time.perf_counter() - t0
        self.clock += dt
        self.update_s += dt
        self.version = version

    def stats(self) -> dict[str, float]:
        s = self.engine.stats
        return {
            "busy_s": self.busy_s,
            "decode_steps": float(self.steps),
            "tokens": float(s.generated_tokens),
            "mean_batch": self.batch_steps / self.steps if self.steps else 0.0,
            "preemptions": 0.0,
            "prefill_tokens": float(s.prefill_tokens),
            "cached_tokens": float(s.cached_prompt_tokens),
            "transfer_tokens": float(self.transfer_tokens),
            "update_s": self.update_s,
        }
