"""Partial rollout: requests that span weight updates or are served in pieces.

A request in flight at a weight update either *continues* (the engine recomputes its KV under the
new weights and stamps later tokens with the new version) or is *aborted and resumed*: its tokens
so far are kept and a continuation request (prompt + those tokens) is queued again. Divided
rollout (Seer) serves every request as such continuations. Either way the request's tokens carry
the version that produced each of them; ``merge`` joins the pieces into one result and
``stale_token_mask`` masks tokens produced by a policy too far behind the trainer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from arborl.types import FinishReason, GenerateRequest, GenerateResult, Sample, SamplingParams


def continuation(prompt: list[int], pieces: Sequence[GenerateResult], params: SamplingParams, *,
                 request_id: str, chunk_tokens: int = 0, priority: int = 0) -> GenerateRequest | None:
    """The next piece of a request: prompt + every token generated so far, at most ``chunk_tokens``
    (0 = all) of the tokens still allowed. None when the request is complete."""
    done = sum(len(p.token_ids) for p in pieces)
    if pieces and pieces[-1].finish_reason == FinishReason.STOP:
        return None
    left = params.max_tokens - done
    if left <= 0:
        return None
    ids = list(prompt) + [t for p in pieces for t in p.token_ids]
    n = min(left, chunk_tokens) if chunk_tokens > 0 else left
    seed = None if params.seed is None else params.seed + len(pieces)
    return GenerateRequest(ids, replace(params, max_tokens=n, seed=seed), request_id=request_id, priority=priority,
                           continued=done)


def merge(prompt: list[int], pieces: Sequence[GenerateResult]) -> GenerateResult:
    """One result from the pieces of a divided or resumed request (tokens, log-probs, versions in order),
    with the last piece's finish reason (the caller, which knows why the pieces stopped, may amend it)."""
    if not pieces:
        raise ValueError("merge needs at least one piece")
    toks = [t for p in pieces for t in p.token_ids]
    reason = pieces[-1].finish_reason
    return GenerateResult(
        request_id=pieces[0].request_id,
        prompt_token_ids=list(prompt),
        token_ids=toks,
        logprobs=[x for p in pieces for x in p.logprobs],
        sample_logprobs=[x for p in pieces for x in p.sample_logprobs],
        versions=[v for p in pieces for v in p.versions],
        finish_reason=reason,
        engine_id=",".join(dict.fromkeys(p.engine_id for p in pieces)),
        cached_prompt_tokens=pieces[0].cached_prompt_tokens,
        queued_s=sum(p.queued_s for p in pieces),
        first_token_s=pieces[0].first_token_s,
        total_s=sum(p.total_s for p in pieces),
    )


def stale_token_mask(versions: Sequence[int], trainer_version: int, max_gap: int | None) -> list[int]:
    """1 for tokens to train on, 0 for tokens of a policy more than ``max_gap`` versions behind the
    trainer; ``versions`` entries < 0 (prompt / tool tokens) get 1 (the loss mask handles them)."""
    if max_gap is None:
        return [1] * len(versions)
    return [1 if v < 0 or trainer_version - v <= max_gap else 0 for v in versions]


def mask_stale(sample: Sample, trainer_version: int, max_gap: int | None) -> tuple[Sample, int]:
    """``sample`` with its loss mask cleared on stale tokens; returns it and the tokens masked."""
    keep = stale_token_mask(sample.versions, trainer_version, max_gap)
    mask = [m * k for m, k in zip(sample.loss_mask, keep)]
    masked = sum(sample.loss_mask) - sum(mask)
    if not masked:
        return sample, 0
    return replace(sample, loss_mask=mask), masked
