"""``arborl show RUN_DIR [--step N] [--n K]``: what the policy generated at a training step, decoded
with the run's tokenizer, with each episode's task id, reward and reward components, read from the
run's data pool. Step N's episodes are the ones the data pool's ledger says step N trained (in the
lineage the run's final weights descend from, after kills and resumes; asynchronous consumption trains
groups of several draws in one step); a data pool without a ledger (an older arborl) falls back to the
groups of draw N-1, ``step{N-1}:{task_id}``, which a synchronous step trains."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arborl.datapool import DataPool
from arborl.datapool.ledger import surviving
from arborl.models.hf_dir import has_tokenizer
from arborl.models.loading import load_tokenizer
from arborl.run_config import run_config
from arborl.types import ArborlError, Episode

_STEP_GROUP = re.compile(r"^step(\d+):")
PROMPT_CHARS = 400  # the end of the first prompt is shown (the system prompt and examples come first)


class ShowError(ArborlError):
    """The run, step or data pool asked for does not exist."""


def _tokenizer(run_dir: Path):
    ckpt = run_dir / "checkpoint"
    if has_tokenizer(ckpt):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(ckpt))
    return load_tokenizer(run_config(run_dir).model)


def _draws(pool: DataPool) -> dict[int, list[str]]:
    """Training draw -> its group ids."""
    out: dict[int, list[str]] = {}
    for gid in pool.group_ids():
        m = _STEP_GROUP.match(gid)
        if m:
            out.setdefault(int(m.group(1)), []).append(gid)
    return out


def _trained(pool: DataPool) -> dict[int, list[str]]:
    """Step -> the episode ids it trained, from the ledger's surviving trainings."""
    led = pool.ledger()
    out: dict[int, list[str]] = {}
    for t in surviving(led["trainings"], led["attempts"]):
        out.setdefault(t["step"], []).append(t["episode_id"])
    return out


def pick(pool: DataPool, step: int | None, n: int) -> tuple[int, list[Episode]]:
    """(the step shown, up to ``n`` of its episodes, taken from each group in turn so several tasks show)."""
    trained = _trained(pool)
    if trained:
        step = max(trained) if step is None else step
        if step not in trained:
            raise ShowError(f"step {step} trained no episodes in {pool.path}; steps that trained: {_span(list(trained))}")
        by_group: dict[str, list[Episode]] = {}
        for eid in trained[step]:
            e = pool.get_episode(eid)
            if e is not None:
                by_group.setdefault(e.group_id, []).append(e)
        return step, _interleave(list(by_group.values()), n)
    draws = _draws(pool)
    if not draws:
        raise ShowError(f"{pool.path} holds no training episodes yet")
    step = max(draws) + 1 if step is None else step
    if step - 1 not in draws:
        raise ShowError(f"no episodes of step {step} in {pool.path}; steps with episodes: {_span([d + 1 for d in draws])}")
    return step, _interleave([pool.episodes(group_id=g) for g in draws[step - 1]], n)


def _span(steps: list[int]) -> str:
    have = sorted(steps)
    return f"{have[0]}-{have[-1]}" if have == list(range(have[0], have[-1] + 1)) else ", ".join(map(str, have))


def _interleave(groups: list[list[Episode]], n: int) -> list[Episode]:
    """Up to ``n`` episodes, one from each group in turn, so several tasks show."""
    chosen: list[Episode] = []
    for i in range(max(map(len, groups), default=0)):
        chosen += [g[i] for g in groups if i < len(g)]
    return chosen[:n]


def _text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))


def transcript(episode: Episode, tokenizer: Any) -> list[str]:
    """The episode's lines: the end of its first prompt, then each generation and what the environment
    added before the next call."""
    lines = []
    end: list[int] = []
    for i, call in enumerate(episode.calls):
        prompt = list(call.prompt_token_ids)
        if i == 0:
            text = _text(tokenizer, prompt)
            cut = len(text) > PROMPT_CHARS
            lines.append(f"  prompt: {'...' if cut else ''}{text[-PROMPT_CHARS:] if cut else text}")
        elif prompt[: len(end)] == end:
            lines.append(f"  env: {_text(tokenizer, prompt[len(end):])}")
        else:
            lines.append(f"  prompt (not extending the previous call): {_text(tokenizer, prompt)}")
        lines.append(f"  model: {_text(tokenizer, list(call.completion_token_ids))}")
        end = prompt + list(call.completion_token_ids)
    return lines


def show_run(run_dir: str | Path, step: int | None = None, n: int = 4, out: Callable[[str], None] = print) -> int:
    """Print ``n`` episodes of ``step`` (default: the last step with episodes); returns the step shown."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    f = run_dir / cfg.datapool.filename
    if not f.is_file():
        raise ShowError(f"{run_dir} has no data pool ({cfg.datapool.filename}): nothing was generated there yet")
    tokenizer = _tokenizer(run_dir)
    with DataPool(f) as pool:
        step, episodes = pick(pool, step, n)
    out(f"step {step} of {run_dir}: {len(episodes)} episode(s)")
    for e in episodes:
        components = ", ".join(f"{k} {v:.3g}" for k, v in sorted(e.reward_components.items()))
        reward = "-" if e.reward is None else f"{e.reward:.3f}"
        out(f"--- task {e.task_id}  reward {reward}  ({components or 'no components'})  {e.status.value}  "
            f"group {e.group_id}  episode {e.episode_id}")
        for line in transcript(e, tokenizer):
            out(line)
    return step
