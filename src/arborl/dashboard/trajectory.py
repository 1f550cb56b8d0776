"""One episode as the trajectory browser shows it: the trainer's view of its recorded calls (the samples
``train/samples.py`` builds: loss mask 1 exactly on generated tokens), each token decoded on its own
from the recorded id with the run's tokenizer, with its rollout log-prob, sampling log-prob, policy
version and, where the trainer's log-probs of the call were recorded (the data pool's trainer_logprobs,
written at the step that trained it), the rollout/trainer mismatch; plus the calls' details, tool interactions, rewards and episode meta."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arborl.config import ConfigError
from arborl.models.hf_dir import has_tokenizer
from arborl.models.loading import load_tokenizer
from arborl.run_config import run_config
from arborl.train.samples import episode_samples, kept_calls
from arborl.types import Call, Episode


class _FastTokenizer:
    """tokenizer.json through the tokenizers library: loads in a fraction of AutoTokenizer's time."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def run_tokenizer(run_dir: Path) -> Any | None:
    """The tokenizer a run's checkpoint holds, else its model's; None when the run has none (token ids only)."""
    ckpt = run_dir / "checkpoint"
    if (ckpt / "tokenizer.json").is_file():
        return _FastTokenizer(ckpt / "tokenizer.json")
    if has_tokenizer(ckpt):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(ckpt))
    try:
        return load_tokenizer(run_config(run_dir).model)
    except (ConfigError, OSError):
        return None


def _pieces(tokenizer: Any | None, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def _call_info(index: int, call: Call) -> dict[str, Any]:
    vs = call.versions
    meta = dict(call.meta or {})
    return {
        "index": index, "call_id": call.call_id, "engine_id": call.engine_id, "finish_reason": call.finish_reason,
        "prompt_tokens": len(call.prompt_token_ids), "completion_tokens": len(call.completion_token_ids),
        "cached_prompt_tokens": call.cached_prompt_tokens, "latency_s": call.latency_s,
        "min_version": min(vs) if vs else None, "max_version": max(vs) if vs else None,
        "drift": meta.pop("drift", None), "meta": meta,
    }


def episode_view(episode: Episode, tokenizer: Any | None, trainer_logprobs: dict[str, list[float]] | None = None,
                 *, tempered: bool = False) -> dict[str, Any]:
    """The JSON the trajectory page draws (see the module docstring); ``trainer_logprobs``: call id ->
    the trainer's log-probs of its generated tokens; ``tempered``: the trainer scored softmax(logits / T)
    and compares with the sampling log-probs (each token's ``blp``: the rollout log-prob the mismatch is
    against)."""
    kept = kept_calls(episode.calls)
    recorded = trainer_logprobs or {}
    trainer = {c.call_id: t if (t := recorded.get(c.call_id)) is not None and len(t) == len(c.completion_token_ids)
               else None for c in kept}
    samples = []
    for s in episode_samples(episode.calls):
        texts = _pieces(tokenizer, s.token_ids)
        tlp: list[float | None] = [None] * len(s.token_ids)
        # the generated tokens of each call, in order, are the sample's mask-1 tokens of its chunk
        positions: dict[int, list[int]] = {}
        for i, (m, ch) in enumerate(zip(s.loss_mask, s.chunk_ids)):
            if m:
                positions.setdefault(ch, []).append(i)
        for ch, pos in positions.items():
            t = trainer.get(kept[ch].call_id)
            if t is not None:
                for i, v in zip(pos, t):
                    tlp[i] = v
        tokens = [{"id": tid, "text": txt, "mask": m, "lp": lp if m else None, "slp": slp if m else None,
                   "blp": blp if m else None, "v": v if m else None, "chunk": ch, "tlp": t}
                  for tid, txt, m, lp, slp, blp, v, ch, t in zip(
                      s.token_ids, texts, s.loss_mask, s.rollout_logprobs, s.sample_logprobs,
                      s.behaviour_logprobs(tempered), s.versions, s.chunk_ids, tlp)]
        samples.append({"call_ids": s.call_ids, "tokens": tokens, "drift_events": s.drift_events,
                        "finish_reason": s.finish_reason})
    kept_ids = {c.call_id for c in kept}
    aborted = [c for c in episode.calls if c.call_id not in kept_ids]
    meta = dict(episode.meta)
    return {
        "episode_id": episode.episode_id, "task_id": episode.task_id, "group_id": episode.group_id,
        "agent_kind": episode.agent_kind, "status": episode.status.value, "reward": episode.reward,
        "reward_components": episode.reward_components, "process_rewards": meta.pop("rewards", []),
        "interactions": episode.interactions, "meta": meta,
        "started_at": episode.started_at, "finished_at": episode.finished_at,
        "calls": [_call_info(i, c) for i, c in enumerate(kept)],
        "aborted_calls": [{**_call_info(i, c), "text": "".join(_pieces(tokenizer, list(c.completion_token_ids)))}
                          for i, c in enumerate(aborted)],
        "samples": samples,
        "has_trainer_logprobs": any(t is not None for t in trainer.values()),
        "decoded": tokenizer is not None,
    }
