"""An episode's recorded calls -> token sequences for the trainer (the per-episode sample view).

``episode_samples(calls)`` walks the calls in recording order. A call whose prompt starts with the
whole token sequence of an existing sample (its last prompt + completion) *extends* that sample:
the new prompt tokens after it (the stitched suffix: tool results, user turns) are appended with
loss mask 0, then the completion with loss mask 1. Any other call starts a new sample (the agent
edited or truncated its history, a retry or resample of an earlier prompt, a side conversation);
such samples share prefixes, which tree packing (P2) computes once. The decision is made on token
ids alone, so it is exact: a mask is never silently wrong. Calls the gateway stitched always
extend their parent; calls it could not stitch carry a drift event (``call.meta["drift"]``) with
the first differing token position, which is copied onto the sample.

Per token:

* ``loss_mask``: 1 exactly on tokens the engine generated in this episode, 0 on prompt and suffix;
* ``logprobs``: the rollout log-probability (raw, temperature 1: what the trainer recomputes and
  compares, S3) on generated tokens, 0.0 elsewhere; ``sample_logprobs`` the same under the
  sampling distribution actually used (behaviour policy);
* ``versions``: the policy version that generated the token, -1 elsewhere;
* ``chunk_ids`` (C4): the index, in episode order, of the call a token belongs to -- the call that
  generated it, or for prompt/suffix tokens the call they are the prompt of. Inside one sample it
  starts at the sample's first call and increments by one at each stitched suffix, i.e. at each
  environment interaction; across samples of an episode the ids do not collide.

Aborted calls (the client disconnected mid-generation; the agent never saw them) are skipped
unless ``include_aborted``; they are still in the data pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from arborl.gateway.stitching import common_prefix_len
from arborl.types import Call, FinishReason, Sample


@dataclass
class SampleTokens:
    episode_id: str
    call_ids: list[str]  # the calls merged into this sample, in order
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    sample_logprobs: list[float]
    versions: list[int]
    chunk_ids: list[int]
    drift_events: list[dict[str, Any]] = field(default_factory=list)  # {"call_id", "position", "reason", ...}
    finish_reason: str = ""  # of the last call

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def validate(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "sample_logprobs", "versions", "chunk_ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sample of {self.episode_id}: {name} has {len(getattr(self, name))} entries, tokens {n}")

    def to_sample(self, *, group_id: str = "", reward: float = 0.0, advantages: float | Sequence[float] = 0.0) -> Sample:
        """The trainer's record. A scalar advantage is put on every generated token (0 elsewhere)."""
        if isinstance(advantages, (int, float)):
            adv = [float(advantages) * m for m in self.loss_mask]
        else:
            adv = [float(a) for a in advantages]
        s = Sample(
            episode_id=self.episode_id,
            group_id=group_id,
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.logprobs),
            versions=list(self.versions),
            chunk_ids=list(self.chunk_ids),
            advantages=adv,
            reward=reward,
        )
        s.validate()
        return s


def _extend(s: SampleTokens, tokens: Sequence[int], chunk: int) -> None:
    s.token_ids.extend(tokens)
    s.loss_mask.extend([0] * len(tokens))
    s.logprobs.extend([0.0] * len(tokens))
    s.sample_logprobs.extend([0.0] * len(tokens))
    s.versions.extend([-1] * len(tokens))
    s.chunk_ids.extend([chunk] * len(tokens))


def _generated(s: SampleTokens, call: Call, chunk: int) -> None:
    n = len(call.completion_token_ids)
    s.token_ids.extend(call.completion_token_ids)
    s.loss_mask.extend([1] * n)
    s.logprobs.extend(float(x) for x in call.logprobs)
    s.sample_logprobs.extend(float(x) for x in call.sample_logprobs)
    s.versions.extend(int(v) for v in call.versions)
    s.chunk_ids.extend([chunk] * n)


def episode_samples(calls: Iterable[Call], *, include_aborted: bool = False) -> list[SampleTokens]:
    """The training samples of one episode's calls (in recording order); see the module docstring."""
    samples: list[SampleTokens] = []
    chunk = -1
    for call in calls:
        if call.finish_reason == FinishReason.ABORT.value and not include_aborted:
            continue
        call.validate()
        chunk += 1
        prompt = call.prompt_token_ids
        target = None
        for s in reversed(samples):  # the longest sample the prompt extends (newest on ties)
            if len(s.token_ids) <= len(prompt) and (target is None or len(s.token_ids) > len(target.token_ids)):
                if common_prefix_len(prompt, s.token_ids) == len(s.token_ids):
                    target = s
        if target is None:
            target = SampleTokens(call.episode_id, [], [], [], [], [], [], [])
            samples.append(target)
            _extend(target, prompt, chunk)
        else:
            _extend(target, prompt[len(target.token_ids) :], chunk)
        _generated(target, call, chunk)
        target.call_ids.append(call.call_id)
        target.finish_reason = call.finish_reason
        drift = call.meta.get("drift") if isinstance(call.meta, dict) else None
        if drift:
            target.drift_events.append({"call_id": call.call_id, **drift})
    return samples
