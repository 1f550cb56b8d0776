"""The data pool -> trainer view: an episode's recorded calls -> ``types.Sample`` records, and a batch
of scored episodes -> samples with advantages.

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
* ``rollout_logprobs``: the rollout log-probability (raw, temperature 1: what the trainer recomputes and
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
from dataclasses import dataclass

import torch

from arborl.config import AdvantageConfig, RewardShapingConfig
from arborl.prefix import common_prefix_len
from arborl.rewards import Estimator, broadcast_to_tokens, estimate, turn_rewards, zero_variance_mask
from arborl.rewards.shaping import compose, speed_rewards
from arborl.types import Call, Episode, EpisodeStatus, FinishReason, Sample


def _new(call: Call) -> Sample:
    return Sample(call.episode_id, "", [], [], [], [], [], [], sample_logprobs=[])


def _extend(s: Sample, tokens: Sequence[int], chunk: int) -> None:
    n = len(tokens)
    s.token_ids.extend(tokens)
    s.loss_mask.extend([0] * n)
    s.rollout_logprobs.extend([0.0] * n)
    s.sample_logprobs.extend([0.0] * n)
    s.versions.extend([-1] * n)
    s.chunk_ids.extend([chunk] * n)
    s.advantages.extend([0.0] * n)


def _generated(s: Sample, call: Call, chunk: int) -> None:
    n = len(call.completion_token_ids)
    s.token_ids.extend(call.completion_token_ids)
    s.loss_mask.extend([1] * n)
    s.rollout_logprobs.extend(float(x) for x in call.logprobs)
    s.sample_logprobs.extend(float(x) for x in call.sample_logprobs)
    s.versions.extend(int(v) for v in call.versions)
    s.chunk_ids.extend([chunk] * n)
    s.advantages.extend([0.0] * n)


def kept_calls(calls: Iterable[Call], *, include_aborted: bool = False) -> list[Call]:
    """The calls that become training tokens, in recording order (aborted ones are not)."""
    return [c for c in calls if include_aborted or c.finish_reason != FinishReason.ABORT.value]


def episode_samples(calls: Iterable[Call], *, include_aborted: bool = False) -> list[Sample]:
    """The training samples of one episode's calls (in recording order), advantages 0; see the module
    docstring."""
    samples: list[Sample] = []
    for chunk, call in enumerate(kept_calls(calls, include_aborted=include_aborted)):
        call.validate()
        prompt = call.prompt_token_ids
        target = None
        for s in reversed(samples):  # the longest sample the prompt extends (newest on ties)
            if len(s.token_ids) <= len(prompt) and (target is None or len(s.token_ids) > len(target.token_ids)):
                if common_prefix_len(prompt, s.token_ids) == len(s.token_ids):
                    target = s
        if target is None:
            target = _new(call)
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
    for s in samples:
        s.validate()
    return samples


def call_token_values(samples: Sequence[Sample], episodes: Sequence[Episode],
                      per_sample: dict[int, Sequence[float]]) -> dict[str, list[float]]:
    """Per call id, the values of its generated tokens from per-next-token values of each sample
    (``per_sample[i][p - 1]`` scores token p of ``samples[i]``, e.g. the trainer's log-probs): a call's
    tokens are the mask-1 positions of its chunk, in order (chunk k = the episode's k-th kept call).
    Calls not every one of whose tokens was scored are left out."""
    kept = {e.episode_id: kept_calls(e.calls) for e in episodes}
    out: dict[str, list[float]] = {}
    for i, s in enumerate(samples):
        values = per_sample.get(i)
        calls = kept.get(s.episode_id)
        if values is None or calls is None:
            continue
        for p, (m, ch) in enumerate(zip(s.loss_mask, s.chunk_ids)):
            if m and 0 < p <= len(values):
                out.setdefault(calls[ch].call_id, []).append(float(values[p - 1]))
    lengths = {c.call_id: len(c.completion_token_ids) for calls in kept.values() for c in calls}
    return {cid: v for cid, v in out.items() if len(v) == lengths[cid]}


# ----------------------------------------------------------------------------- a batch of episodes


def usable(episode: Episode) -> bool:
    """Episodes with calls are trained on -- an agent's own failure (an exception, a timeout) is an
    ordinary low-reward episode -- except infrastructure failures (``meta["infra_error"]``: a worker
    died, a sandbox did not start, the gateway failed), which say nothing about the policy, and
    episodes still running."""
    return (episode.status != EpisodeStatus.RUNNING and bool(episode.calls)
            and not episode.meta.get("infra_error"))


def turn_process_rewards(episode: Episode) -> list[float]:
    """The agent's process rewards (``episode.meta["rewards"]``, C1) summed per turn: turn k = the
    episode's k-th kept call (its chunk id); a reward names its call, else the call it came after,
    else the last turn."""
    kept = [c.call_id for c in kept_calls(episode.calls)]
    out = [0.0] * len(kept)
    for r in episode.meta.get("rewards", []):
        ref = r.get("call_id") or r.get("after_call")
        k = kept.index(ref) if ref in kept else len(kept) - 1
        if k >= 0:
            out[k] += float(r["value"])
    return out


def episode_turn_rewards(episode: Episode) -> list[float]:
    """Per-turn rewards of a scored episode: its process rewards, the outcome on the last turn."""
    process = turn_process_rewards(episode)
    return turn_rewards(float(episode.reward or 0.0), len(process), process)


def completion_cost(episode: Episode, metric: str) -> float:
    """How long an episode took to finish (C2): ``wall_time`` = seconds from start to finish (the sum of
    its calls' latencies when it has no finish time), ``turns`` = kept model calls, ``tokens`` =
    generated tokens of its kept calls."""
    calls = kept_calls(episode.calls)
    if metric == "turns":
        return float(len(calls))
    if metric == "tokens":
        return float(sum(len(c.completion_token_ids) for c in calls))
    if metric == "wall_time":
        if episode.finished_at is not None and episode.finished_at >= episode.started_at:
            return float(episode.finished_at - episode.started_at)
        return float(sum(c.latency_s for c in calls))
    raise ValueError(f"unknown completion-time metric {metric!r}: wall_time, turns or tokens")


def shaped_rewards(episodes: Sequence[Episode], shaping: RewardShapingConfig) -> tuple[list[float], list[list[float]]]:
    """(shaped outcome R' [N], per-turn rewards [N][K_n]) of scored, usable episodes under
    ``train.advantage.shaping`` (``rewards/shaping.py``): process rewards weighted on their turns, the
    completion-time reward relative to the group and the outcome on the last turn."""
    outcome = [float(e.reward or 0.0) for e in episodes]
    speed = [0.0] * len(episodes)
    if shaping.speed_weight > 0:
        costs = [completion_cost(e, shaping.speed_metric) for e in episodes]
        # success is the task's outcome, not the reward (which partial credit may lift to 1 without it)
        eligible = ([float(e.reward_components.get("outcome", e.reward or 0.0)) >= 1.0 for e in episodes]
                    if shaping.speed_success_only else None)
        speed = speed_rewards(costs, [e.group_id for e in episodes], eligible)
    shaped, turns = [], []
    for e, o, sp in zip(episodes, outcome, speed):
        r, t = compose(o, turn_process_rewards(e), sp, process_weight=shaping.process_weight,
                       speed_weight=shaping.speed_weight, outcome_weight=shaping.outcome_weight)
        shaped.append(r)
        turns.append(t)
    return shaped, turns


@dataclass
class BatchStats:
    episodes: int = 0
    unusable: int = 0
    groups: int = 0
    zero_variance_groups: int = 0
    samples: int = 0


def build_samples(
    episodes: Sequence[Episode], adv_cfg: AdvantageConfig, estimator: Estimator | None = None
) -> tuple[list[Sample], BatchStats]:
    """The training samples of scored episodes (``episode.reward`` set): unusable episodes and, with
    ``adv_cfg.drop_zero_variance``, groups whose (shaped) outcomes are all equal and that hold no
    process reward are left out (and counted). Rewards are composed by ``adv_cfg.shaping``
    (:func:`shaped_rewards`); the estimator (``adv_cfg.estimator`` unless given) makes one advantage per
    episode or one per turn, and ``broadcast_to_tokens`` puts it on the episode's generated tokens (per
    turn: by chunk id, C4)."""
    stats = BatchStats(episodes=len(episodes))
    kept = [e for e in episodes if usable(e)]
    stats.unusable = len(episodes) - len(kept)
    if not kept:
        return [], stats
    groups = [e.group_id for e in kept]
    stats.groups = len(set(groups))
    shaped, turns = shaped_rewards(kept, adv_cfg.shaping)
    rewards = torch.tensor(shaped, dtype=torch.float64)
    zero = [False] * len(kept)
    if adv_cfg.drop_zero_variance:
        # a process reward is signal even when the outcomes agree (it moves its own turn)
        has_process = {g for g, t, r in zip(groups, turns, shaped) if any(t[:-1]) or (t and t[-1] != r)}
        flat = zero_variance_mask(rewards, groups, tol=adv_cfg.zero_variance_tol).tolist()
        zero = [z and g not in has_process for z, g in zip(flat, groups)]
        stats.zero_variance_groups = len({g for g, z in zip(groups, zero) if z})
    adv = torch.as_tensor(estimate(adv_cfg, rewards, turns, groups, estimator), dtype=torch.float64)
    if adv.dim() not in (1, 2) or adv.shape[0] != len(kept):
        raise ValueError(f"advantage estimator {adv_cfg.estimator!r} returned shape {tuple(adv.shape)}; "
                         f"expected [{len(kept)}] (per episode) or [{len(kept)}, turns]")
    samples: list[Sample] = []
    for i, (e, z) in enumerate(zip(kept, zero)):
        if z:
            continue
        for s in episode_samples(e.calls):
            s.group_id, s.reward = e.group_id, float(e.reward or 0.0)
            chunks = torch.tensor([s.chunk_ids]) if adv.dim() == 2 else None
            s.advantages = broadcast_to_tokens(adv[i : i + 1], torch.tensor([s.loss_mask]), chunks)[0].tolist()
            samples.append(s)
    stats.samples = len(samples)
    return samples, stats
