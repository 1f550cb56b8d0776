"""The simulator calibrated on a run of the code-repair job, predicting each configuration's step time.

``sim_knobs(run_dir, engine_fit)`` reads the workload and the trainer from the baseline run's own trace
(its data pool and metrics.jsonl): groups and their size, the first prompt's length, the per-turn generated
lengths (median, log-sd between and within groups), turns, the tokens each tool result adds, the
environment's latency between turns (from each call's start and latency), the share of groups whose
rewards differ (under the configuration's own reward components, recomputed from each episode's recorded
ones: partial credit turns all-fail groups into mixed ones), the trainer's mean time per generated token of
the groups it trained, and the publish time. ``engine_fit`` gives the decode and prefill
lines measured on the job's model (``arborl.sim.calibrate.calibrate``). ``predict(knobs, variant,
scheduling)`` then simulates a configuration (consume/dispatch, ``sim.spec_acceptance``) and returns its mean
step time.

What the simulator does not model: an engine and a trainer sharing the same cores (on this 2-core machine
asynchronous consumption slows both; the simulator gives each its own), the adaptive draft length (it
drafts ``spec_max_k`` at the measured per-position acceptance on every step), and which task a group
draws (each simulated group is its own task, so dynamic sampling never skips a task for its history).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any


def _log_sd(xs: list[float], floor: float) -> float:
    """Standard deviation of the logs of ``xs`` (each at least ``floor``: an empty answer is not log 0)."""
    logs = [math.log(max(floor, x)) for x in xs]
    return statistics.pstdev(logs) if len(logs) > 1 else 0.0


def _lognormal_by_moments(xs: list[float]) -> dict[str, float]:
    """``env_median_s`` and ``env_sigma`` of the lognormal with the mean and variance of ``xs`` (a fit of the
    logs would let a few near-zero gaps blow the spread up, and the tail's mean with it)."""
    if not xs:
        return {"env_median_s": 0.0, "env_sigma": 0.0}
    mean, var = statistics.mean(xs), statistics.pvariance(xs)
    s2 = math.log(1 + var / mean**2)
    return {"env_median_s": mean / math.sqrt(1 + var / mean**2), "env_sigma": math.sqrt(s2)}


def _mixed_groups(groups: dict[str, list], reward) -> list[str]:
    """The groups whose rewards (``reward(episode)``) differ, by the trainer's own zero-variance rule."""
    from arborl.rewards.advantages import zero_variance_groups

    eps = [e for g in groups.values() for e in g]
    equal = set(zero_variance_groups([reward(e) for e in eps], [e.group_id for e in eps]))
    return [gid for gid in groups if gid not in equal]


def sim_knobs(run_dir: Path, engine_fit: dict[str, float], *, max_batch: int,
              component_weights: dict[str, float] | None = None) -> dict[str, Any]:
    """``sim.*`` knobs from a run's trace (module docstring); ``component_weights``: the reward components
    the predicted configuration adds to the trace's rewards (``train.advantage.shaping.component_weights``)."""
    from arborl.datapool import DataPool
    from arborl.rewards.shaping import task_reward

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("kind") == "step"]
    with DataPool(run_dir / "datapool.sqlite") as pool:
        episodes = [e for e in pool.episodes(with_calls=True) if e.calls and not e.group_id.startswith("eval")]
    groups: dict[str, list] = {}
    for e in episodes:
        groups.setdefault(e.group_id, []).append(e)
    lengths = [len(c.completion_token_ids) for e in episodes for c in e.calls]
    per_group = [[len(c.completion_token_ids) for e in g for c in e.calls] for g in groups.values()]
    group_means = [statistics.mean(ls) for ls in per_group]
    within = [n / m for ls, m in zip(per_group, group_means) for n in ls]  # each answer against its group's mean
    obs, env = [], []
    for e in episodes:
        for a, b in zip(e.calls, e.calls[1:]):
            obs.append(len(b.prompt_token_ids) - len(a.prompt_token_ids) - len(a.completion_token_ids))
            env.append(max(1e-3, b.created_at - (a.created_at + a.latency_s)))
    # the trainer: its mean time per generated token of the groups it trained (all-equal groups train nothing)
    trained = _mixed_groups(groups, lambda e: e.reward or 0.0)
    trained_tokens = sum(len(c.completion_token_ids) for gid in trained for e in groups[gid] for c in e.calls)
    per_ktoken = sum(r.get("train_s", 0.0) for r in steps) / (trained_tokens / 1000.0) if trained_tokens else 0.0
    # the configuration's rewards, as its controller would compute them from each episode's components
    mixed = _mixed_groups(groups, lambda e: task_reward(e.reward_components, component_weights or {}))
    turns = max(len(e.calls) for e in episodes)
    return {
        "prompts": max(1, round(len(groups) / max(1, len(steps)))), "group_size": max(len(g) for g in groups.values()),
        "steps": len(steps), "instances": 1, "max_batch": max_batch,
        "prompt_tokens": round(statistics.mean(len(e.calls[0].prompt_token_ids) for e in episodes)),
        "length_median": float(statistics.median(lengths)), "sigma_prompt": _log_sd(group_means, 1.0),
        "sigma_member": _log_sd(within, 0.01), "max_tokens": max(lengths), "min_tokens": 1,
        "turns": turns, "obs_tokens": max(0, round(statistics.mean(obs))) if obs else 0,
        **_lognormal_by_moments(env), "mixed_fraction": len(mixed) / len(groups),
        "train_base_s": 0.0, "train_per_ktoken_s": per_ktoken,
        "weight_update_s": statistics.mean(r.get("publish_s", 0.0) for r in steps),
        "kv_capacity_tokens": 10**7, **engine_fit,
    }


def _sets(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def component_weights_of(overrides: list[str]) -> dict[str, float]:
    """The reward components a configuration's ``--set`` overrides add (partial credit), {} if none."""
    import yaml

    weights = yaml.safe_load(_sets(overrides).get("train.advantage.shaping.component_weights", "{}")) or {}
    return {k: float(v) for k, v in weights.items()}


# configuration -> (variant, scheduling knobs, sim knobs) it is predicted with
def variant_of(name: str, overrides: list[str], spec_acceptance: float | None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """How ``arborl simulate`` runs a configuration of the bench (its ``--set`` overrides)."""
    sets = _sets(overrides)
    consume = sets.get("scheduling.consume", "sync")
    sched = {k.split(".", 1)[1]: v for k, v in sets.items() if k.startswith("scheduling.") and k != "scheduling.consume"}
    extra: dict[str, Any] = {}
    if sets.get("engine.spec.enabled") == "true" and spec_acceptance:
        extra["spec_acceptance"] = min(0.99, spec_acceptance)
    return f"{consume}/pinned", sched, extra


def predict(knobs: dict[str, Any], variant: str, scheduling: dict[str, Any] | None = None) -> float:
    """Mean simulated step time of ``variant`` (consume/dispatch) on the calibrated workload."""
    from arborl.config import load_config
    from arborl.sim import run_variant

    sets = [f"sim.{k}={v}" for k, v in knobs.items()] + [f"scheduling.{k}={v}" for k, v in (scheduling or {}).items()]
    cfg = load_config(None, sets)
    res, _ = run_variant(cfg, variant)
    return float(res.figures["step_s"])
