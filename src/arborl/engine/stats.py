"""The built-in engine's counters (``LLMEngine.stats``, ``stats_dict``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose prefill was skipped
    prefill_tokens: int = 0  # tokens actually run through prefill (incl. recompute after updates)
    batch_size_sum: int = 0
    max_batch_size: int = 0
    finished: int = 0
    aborted: int = 0
    weight_updates: int = 0
    busy_s: float = 0.0
    started_at: float = field(default_factory=time.perf_counter)

    def as_dict(self, *, waiting: int, running: int, cached_tokens: int) -> dict:
        return {
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "cache_hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "tokens_per_s": self.generated_tokens / self.busy_s if self.busy_s else 0.0,
            "mean_batch_size": self.batch_size_sum / self.decode_steps if self.decode_steps else 0.0,
            "max_batch_size": self.max_batch_size,
            "finished": self.finished,
            "aborted": self.aborted,
            "weight_updates": self.weight_updates,
            "busy_s": self.busy_s,
            "queue_length": waiting,
            "running": running,
            "prefix_cache_tokens": cached_tokens,
        }

    def decode_step(self, batch_size: int) -> None:
        """One decode (or verify) forward over ``batch_size`` sequences."""
        self.decode_steps += 1
        self.batch_size_sum += batch_size
        self.max_batch_size = max(self.max_batch_size, batch_size)
