"""Discrete-event simulator of rollout clusters, driving the policies of ``arborl.scheduling``.

``simulate(cfg)`` runs every variant of ``cfg.sim.policies`` (consume/dispatch) on the workload and
cluster of ``cfg.sim`` with the knobs of ``cfg.scheduling`` and returns one dict of figures per
variant plus ratios against the first sync/pinned variant (``arborl simulate`` prints it as JSON).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from arborl.config import Config, ConfigError, SchedulingConfig, SimConfig
from arborl.config.scheduling import AFFINITY
from arborl.registry import RegistryError
from arborl.scheduling.consume import CONSUME_POLICIES, make_consume
from arborl.scheduling.dispatch import DISPATCH_POLICIES, make_dispatch
from arborl.scheduling.policies import Traced
from arborl.scheduling.timeline import Timeline
from arborl.sim.cost import CostModel
from arborl.sim.instance import SimInstance
from arborl.sim.loop import RolloutDriver, RunResult, SimDeadlock
from arborl.sim.workload import Workload

__all__ = ["CostModel", "RolloutDriver", "RunResult", "SimDeadlock", "SimInstance", "Workload", "build_policies", "check_variants",
           "cost_model", "run_variant", "simulate", "workload"]


def workload(sim: SimConfig) -> Workload:
    return Workload(
        group_size=sim.group_size, prompt_tokens=sim.prompt_tokens, length_median=sim.length_median,
        sigma_prompt=sim.sigma_prompt, sigma_member=sim.sigma_member, max_tokens=sim.max_tokens,
        min_tokens=min(sim.min_tokens, sim.max_tokens), turns=sim.turns, obs_tokens=sim.obs_tokens,
        env_median_s=sim.env_median_s, env_sigma=sim.env_sigma, mixed_fraction=sim.mixed_fraction,
        seed=sim.seed,
    )


def cost_model(sim: SimConfig) -> CostModel:
    return CostModel(
        decode_base_s=sim.decode_base_s, decode_per_seq_s=sim.decode_per_seq_s,
        decode_per_ctx_token_s=sim.decode_per_ctx_token_s, prefill_base_s=sim.prefill_base_s,
        prefill_per_token_s=sim.prefill_per_token_s, prefill_per_token2_s=sim.prefill_per_token2_s,
        transfer_per_token_s=sim.transfer_per_token_s,
        kv_capacity_tokens=sim.kv_capacity_tokens, max_batch=sim.max_batch, weight_update_s=sim.weight_update_s,
        spec_acceptance=sim.spec_acceptance, spec_max_k=sim.spec_max_k,
    )


def parse_variant(variant: str) -> tuple[str, str]:
    consume, sep, dispatch = variant.partition("/")
    if not sep:
        raise ValueError(f"policy variant {variant!r} must look like consume/dispatch, e.g. sync/seer")
    return consume.strip(), dispatch.strip()


def build_policies(sched: SchedulingConfig, consume: str, dispatch: str, *, batch_size: int, instances: int,
                   version: int = 0):
    """The policy objects a controller or the simulator uses, from the scheduling knobs."""
    return make_consume(sched, batch_size, name=consume, version=version), make_dispatch(sched, instances, name=dispatch)


def run_variant(cfg: Config, variant: str, *, trace: bool = False, timeline: bool = False,
                instances=None, dispatch_policy=None) -> tuple[RunResult, dict]:
    """One variant on ``cfg.sim``; returns the run and (if ``trace``) the recorded policy calls.
    ``dispatch_policy`` replaces the variant's dispatch policy (a reference such as an oracle)."""
    sim, sched = cfg.sim, cfg.scheduling
    consume, dispatch = parse_variant(variant)
    c, d = build_policies(sched, consume, dispatch, batch_size=sim.prompts, instances=sim.instances)
    if dispatch_policy is not None:
        d = dispatch_policy
    if trace:
        c, d = Traced(c), Traced(d)
    cost = cost_model(sim)
    insts = instances if instances is not None else [SimInstance(i, cost, migration=sched.migration) for i in range(sim.instances)]
    drv = RolloutDriver(
        workload(sim), insts, c, d, steps=sim.steps,
        train_s=lambda tokens: sim.train_base_s + sim.train_per_ktoken_s * tokens / 1000.0,
        partial_rollout=sched.partial_rollout, timeline=Timeline() if timeline else None,
        drop_equal=cfg.train.advantage.drop_zero_variance,
    )
    res = drv.run()
    calls = {"consume": c.calls, "dispatch": d.calls} if trace else {}
    return res, calls


_HEADLINE = ("time_s", "step_s", "rollout_tokens_per_s", "train_tokens_per_s", "batch_makespan_s", "tail_s",
             "utilization", "mean_batch", "preemptions", "generated_tokens", "trained_tokens", "wasted_tokens",
             "consume_dropped", "consume_cancelled", "consume_max_version_gap", "consume_mean_version_gap",
             "consume_max_out_of_order", "dispatch_migrations", "dispatch_chunks", "prefill_tokens",
             "transfer_tokens", "wall_s")


def check_variants(variants: list[str]) -> None:
    """ConfigError naming sim.policies unless every variant is consume/dispatch of known policies."""
    for variant in variants:
        try:
            consume, dispatch = parse_variant(variant)
            CONSUME_POLICIES.get(consume)
            DISPATCH_POLICIES.get(dispatch)
            if dispatch == AFFINITY:
                make_dispatch(SchedulingConfig(), 1, name=dispatch)  # raises: not a dispatch policy
        except (ValueError, RegistryError) as e:
            raise ConfigError(f"sim.policies: {e}") from None


def simulate(cfg: Config, *, full: bool = False, progress=None) -> dict:
    """Every variant of ``cfg.sim.policies`` on one workload: per-policy figures and ratios."""
    check_variants(cfg.sim.policies)  # a typo in the last variant fails now, not after simulating the others
    out: dict = {"workload": {k: v for k, v in cfg.sim.model_dump().items() if k not in ("policies", "gantt_dir")},
                 "scheduling": cfg.scheduling.model_dump(), "policies": {}}
    gdir = Path(cfg.sim.gantt_dir) if cfg.sim.gantt_dir else None
    for variant in cfg.sim.policies:
        t0 = time.perf_counter()
        res, _ = run_variant(cfg, variant, timeline=gdir is not None)
        figs = dict(res.figures)
        figs["wall_s"] = time.perf_counter() - t0
        if progress is not None:
            progress(variant, figs)
        if gdir is not None and res.timeline is not None:
            png = res.timeline.gantt(gdir / f"{variant.replace('/', '_')}.png", title=f"{variant} (simulated)")
            figs["gantt"] = str(png)
        out["policies"][variant] = figs if full else {k: figs[k] for k in (*_HEADLINE, "gantt") if k in figs}
    base = next((v for v in cfg.sim.policies if v.startswith("sync/pinned")), None)
    if base is not None:
        b = out["policies"][base]
        out["ratios_vs_" + base.replace("/", "_")] = {
            v: {
                "rollout_throughput": _ratio(f["rollout_tokens_per_s"], b["rollout_tokens_per_s"]),
                "train_throughput": _ratio(f["train_tokens_per_s"], b["train_tokens_per_s"]),
                "tail_reduction": 1 - _ratio(f["tail_s"], b["tail_s"]) if b["tail_s"] else 0.0,
            }
            for v, f in out["policies"].items() if v != base
        }
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf
