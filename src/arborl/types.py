"""The core records that flow through arborl (DESIGN section 5).

Token ids always come from the engine; nothing here is ever re-tokenised from text.
Two log-probabilities are kept per generated token:

* ``logprobs``: the raw temperature-1 log-probability of the token under the policy
  that produced it -- what the trainer recomputes and compares against (S3);
* ``sample_logprobs``: the log-probability under the distribution the token was actually
  drawn from (after temperature / top-k / top-p), i.e. the behaviour policy.
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any


class ArborlError(Exception):
    """Base class of every error arborl raises on purpose."""


class InvalidRequestError(ArborlError, ValueError):
    """A request or record is malformed; the message says what to fix."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # aborted by the caller; holds what was generated so far


class EpisodeStatus(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    ignore_eos: bool = False  # keep going past EOS (benchmarks forcing lengths)
    seed: int | None = None  # per-request RNG seed: same seed, same tokens

    def validate(self) -> None:
        if not (self.temperature >= 0.0):
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class GenerateRequest:
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: new_id("req"))
    priority: int = 0  # higher runs first when the engine must choose (Seer probes)

    def validate(self, vocab_size: int, max_seq_len: int) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids is empty: send at least one token")
        bad = [t for t in self.prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids contains {len(bad)} id(s) outside [0, {vocab_size}), e.g. {bad[0]!r}"
            )
        if len(self.prompt_token_ids) >= max_seq_len:
            raise InvalidRequestError(
                f"prompt has {len(self.prompt_token_ids)} tokens but the context holds {max_seq_len}: "
                "shorten the prompt or raise engine.max_seq_len"
            )
        self.params.validate()


@dataclass(slots=True)
class GenerateResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # raw temperature-1 log-probs (what the trainer recomputes)
    sample_logprobs: list[float]  # log-probs under the sampling distribution
    versions: list[int]  # policy version that produced each token
    finish_reason: FinishReason
    engine_id: str = ""
    cached_prompt_tokens: int = 0  # prompt tokens whose prefill was skipped (prefix cache)
    queued_s: float = 0.0  # submit -> first scheduled
    first_token_s: float = 0.0  # submit -> first token
    total_s: float = 0.0  # submit -> finished


@dataclass(slots=True)
class Call:
    """One LLM request as served and recorded."""

    episode_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    sample_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    call_id: str = field(default_factory=lambda: new_id("call"))
    engine_id: str = ""
    created_at: float = field(default_factory=time.time)
    latency_s: float = 0.0
    cached_prompt_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # tool-call parse errors, drift events, ...

    def validate(self) -> None:
        n = len(self.completion_token_ids)
        for name in ("logprobs", "sample_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise InvalidRequestError(
                    f"call {self.call_id}: {name} has {len(getattr(self, name))} entries "
                    f"but there are {n} completion tokens"
                )

    @classmethod
    def from_result(cls, episode_id: str, result: GenerateResult, **kw: Any) -> "Call":
        return cls(
            episode_id=episode_id,
            prompt_token_ids=list(result.prompt_token_ids),
            completion_token_ids=list(result.token_ids),
            logprobs=list(result.logprobs),
            sample_logprobs=list(result.sample_logprobs),
            versions=list(result.versions),
            finish_reason=result.finish_reason.value,
            engine_id=result.engine_id,
            latency_s=result.total_s,
            cached_prompt_tokens=result.cached_prompt_tokens,
            **kw,
        )


@dataclass(slots=True)
class Episode:
    task_id: str
    group_id: str = ""
    agent_kind: str = "whitebox"
    status: EpisodeStatus = EpisodeStatus.RUNNING
    episode_id: str = field(default_factory=lambda: new_id("ep"))
    calls: list[Call] = field(default_factory=list)
    interactions: list[dict[str, Any]] = field(default_factory=list)  # environment steps
    reward_components: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def min_version(self) -> int | None:
        vs = [v for c in self.calls for v in c.versions]
        return min(vs) if vs else None


@dataclass(slots=True)
class Sample:
    """What the trainer sees: one token sequence with its per-token annotations."""

    episode_id: str
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 only on model-generated tokens
    rollout_logprobs: list[float]  # 0.0 where loss_mask is 0
    versions: list[int]  # -1 where loss_mask is 0
    chunk_ids: list[int]  # C4: index of the span between two environment interactions
    advantages: list[float]
    reward: float = 0.0

    def validate(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "rollout_logprobs", "versions", "chunk_ids", "advantages"):
            if len(getattr(self, name)) != n:
                raise InvalidRequestError(f"sample {self.episode_id}: {name} length != token_ids length {n}")


@dataclass(slots=True)
class Task:
    task_id: str
    prompt: str | list[dict[str, Any]]  # plain text or chat messages
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. the answer, difficulty
    split: str = "train"


def to_dict(record: Any) -> dict[str, Any]:
    """JSON-ready dict of a record (enums become their values)."""
    d = asdict(record)
    for k, v in d.items():
        if isinstance(v, enum.Enum):
            d[k] = v.value
    return d
