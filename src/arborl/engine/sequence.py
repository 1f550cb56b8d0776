"""One request's state inside the engine: its tokens, where its KV lives, what it produced."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from arborl.types import FinishReason, GenerateRequest, GenerateResult

TokenRows = list[tuple[int, float, float]]  # a step's new tokens of one sequence: (token, log-prob, sampling log-prob)


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    seed: int  # the request's sampling seed: position t's token is drawn by sampling.position_uniform(seed, t)
    arrival: int  # admission order among equal priorities
    submitted_at: float = field(default_factory=time.perf_counter)
    state: SeqState = SeqState.WAITING
    slot: int = -1  # row of the KV slot cache while running
    kv_len: int = 0  # tokens whose KV is in the slot (always len(tokens) - 1 while decoding)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sample_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    finish_reason: FinishReason | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    on_token: Callable[["Sequence"], None] | None = None  # called (engine thread) after each token

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.output

    @property
    def next_position(self) -> int:
        """Index in ``tokens`` of the token to be sampled next."""
        return len(self.request.prompt_token_ids) + len(self.output)

    def sort_key(self) -> tuple[int, int]:
        return (-self.request.priority, self.arrival)

    def append(self, token: int, logprob: float, sample_logprob: float, version: int) -> None:
        self.output.append(token)
        self.logprobs.append(logprob)
        self.sample_logprobs.append(sample_logprob)
        self.versions.append(version)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def result(self, engine_id: str) -> GenerateResult:
        assert self.finish_reason is not None
        end = self.finished_at or time.perf_counter()
        return GenerateResult(
            request_id=self.request_id,
            prompt_token_ids=list(self.request.prompt_token_ids),
            token_ids=list(self.output),
            logprobs=list(self.logprobs),
            sample_logprobs=list(self.sample_logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            engine_id=engine_id,
            cached_prompt_tokens=self.cached_prompt_tokens,
            queued_s=((self.scheduled_at or end) - self.submitted_at),
            first_token_s=((self.first_token_at or end) - self.submitted_at),
            total_s=end - self.submitted_at,
        )
