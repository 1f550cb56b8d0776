"""Plain text lines a run prints: one per step (what nohup and Slurm logs keep), and the warning of a
step that trained nothing."""

from __future__ import annotations

from typing import Any


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "step")`` -> "1 step", ``plural(3, "step")`` -> "3 steps"."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def step_line(m: dict[str, Any], total: int) -> str:
    """``step 3/10  reward 0.42  success 0.25  412 tok/s  step 3.2s  loss 0.0123``."""
    loss = m.get("loss/total")
    return (f"step {m['step']}/{total}  reward {m['reward']:.3f}  success {m['success']:.3f}  "
            f"{m['rollout_tokens_per_s']:.0f} tok/s  step {m['step_s']:.1f}s  "
            f"loss {'-' if loss is None else f'{loss:.4g}'}")


def idle_reason(m: dict[str, Any], group_size: int) -> str:
    """Why a step with ``samples == 0`` trained nothing, from its metrics."""
    groups = max(1, round(m.get("episodes", 0) / max(1, group_size)))
    parts = []
    zero = m.get("zero_variance_groups", 0)
    if zero:
        mean = m.get("reward", 0.0)
        parts.append(f"{zero} of {plural(groups, 'group')} had the same reward for every episode (mean reward "
                     f"{mean:.2f}), so every advantage was 0")
    unusable = m.get("unusable_episodes", 0)
    if unusable:
        parts.append(f"{unusable} of {plural(m.get('episodes', 0), 'episode')} were unusable (failed or aborted)")
    return "; ".join(parts) or "no episode gave a trainable sample"


IDLE_ADVICE = ("make rewards differ within a group: raise rollout.group_size or rollout.temperature, give partial "
               "credit in the reward, or pick tasks the model sometimes but not always solves")


def idle_warning(m: dict[str, Any], group_size: int, idle: int, max_idle: int) -> str:
    stop = (f"; {plural(max_idle - idle, 'more such step')} in a row stop the run (rollout.max_idle_steps={max_idle})"
            if 0 < idle < max_idle else "")
    return f"warning: step {m['step']} trained nothing: {idle_reason(m, group_size)}. To fix: {IDLE_ADVICE}{stop}"
