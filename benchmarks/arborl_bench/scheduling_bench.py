"""``arborl bench scheduling``: rollout scheduling for the long tail, simulated and on real engines.

1. calibration: decode step and prefill times of the built-in engine (the tiny model of part 4),
   least-squares fit of the simulator's cost lines, every point shown with its prediction;
2. simulator, Seer-like workload (400 prompts x 8, lognormal lengths capped at 64K, 32 instances of
   a GPU-class cost model): sync/pinned (veRL-like naive sync), sync/seer, async_ratio/pinned (α=1),
   windowed_fifo/pinned (W = 0.3 N), Seer ablations; several seeds, pooled;
3. simulator, agentic workload (multi-turn episodes with long-tailed environment latency, training
   time per step): sync vs async α=1 vs windowed FIFO;
4. real engines: 2 built-in engine instances (tiny Llama, CPU), long-tailed lengths forced with
   ignore_eos, the same policy classes driven by the same driver, each instance's clock advanced by
   its measured step times; ratios, next to the simulator's prediction for the same workload with
   the calibrated cost model; and KV migration measured: recompute vs transfer;
5. the product path: the gateway's Dispatcher over 2 in-process engines (wall clock; they share this
   machine's cores), Seer vs pinned, and the cost of serving requests in pieces on one engine.
Gantt PNGs of the simulated sync/pinned and sync/seer steps go to runs/bench-scheduling/.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from arborl.config import Config, EngineConfig, load_config
from arborl.engine import LLMEngine
from arborl.models import tiny_llama
from arborl.scheduling.dispatch import SeerDispatch
from arborl.scheduling.timeline import Timeline
from arborl.sim import build_policies, cost_model, parse_variant, run_variant, workload
from arborl.sim.calibrate import calibrate
from arborl.sim.cost import CostModel
from arborl.sim.engine_instance import EngineInstance, TokenStore, transfer_kv
from arborl.sim.instance import SimInstance
from arborl.sim.loop import RolloutDriver
from arborl.types import GenerateRequest, SamplingParams

OUT_DIR = Path("runs") / "bench-scheduling"

SEER_WORKLOAD = [  # GPU-class instance: ~70B dense model on 4 accelerators (weights read per step, KV reads)
    "sim.prompts=400", "sim.group_size=8", "sim.instances=32", "sim.max_tokens=65536", "sim.length_median=10000",
    "sim.sigma_prompt=1.0", "sim.sigma_member=0.35", "sim.kv_capacity_tokens=540000", "sim.max_batch=256",
    "sim.decode_base_s=0.02", "sim.decode_per_seq_s=5e-5", "sim.decode_per_ctx_token_s=2.4e-8",
    "sim.prefill_per_token_s=7e-5", "sim.transfer_per_token_s=2e-6", "sim.train_base_s=120",
    "sim.train_per_ktoken_s=0.005", "sim.weight_update_s=20", "scheduling.chunk_tokens=4096",
    "scheduling.migration=transfer",
]
AGENTIC_WORKLOAD = [
    "sim.prompts=64", "sim.group_size=8", "sim.instances=8", "sim.turns=8", "sim.length_median=400",
    "sim.sigma_prompt=0.7", "sim.sigma_member=0.5", "sim.max_tokens=4096", "sim.prompt_tokens=1024",
    "sim.obs_tokens=200", "sim.env_median_s=5", "sim.env_sigma=1.2", "sim.kv_capacity_tokens=540000",
    "sim.decode_per_ctx_token_s=2.4e-8", "sim.prefill_per_token_s=7e-5", "sim.train_base_s=60",
    "sim.train_per_ktoken_s=0.02", "sim.weight_update_s=10",
]
TINY = dict(layers=4, hidden=256, vocab=4096, heads=8, kv_heads=4, max_position=4096)


# ------------------------------------------------------------------------------------ simulator


class OracleLongestFirst(SeerDispatch):
    """Reference, not a policy anyone can run: divided rollout, longest-first by every request's true
    length, known in advance (the "oracle" Seer compares its context-aware scheduling with). How close
    Seer's estimate gets to it, and the tail even perfect ordering leaves, bound what dispatch can do."""

    def __init__(self, wl, *, chunk_tokens: int) -> None:
        super().__init__(chunk_tokens=chunk_tokens, context_aware=True)
        self._wl = wl
        self._lengths: dict[str, int] = {}

    def _true_length(self, rid: str) -> int:  # ids are g<group>/m<member>/t<turn> (sim.loop)
        if rid not in self._lengths:
            g, m, t = rid.split("/")
            plan = self._wl.group(int(g[1:]))[int(m[1:])]
            self._lengths[rid] = plan.turns[int(t[1:])].tokens
        return self._lengths[rid]

    def _is_probe(self, r) -> bool:
        return False

    def _push(self, r) -> None:
        r.key_ticket += 1
        heapq.heappush(self._heap, (-self._true_length(r.request_id), r.enq, r.key_ticket, r.request_id))


def _pooled(cfgs: list[Config], variants: list[str], *, timeline_dir: Path | None = None) -> dict[str, dict]:
    """Each variant on every config (seeds); sums of times and tokens, so ratios are pooled."""
    out: dict[str, dict] = {}
    for v in variants:
        acc: dict[str, float] = {}
        tails, makespans = [], []
        for k, cfg in enumerate(cfgs):
            name, _, ablation = v.partition("|")  # "sync/seer|context_aware=false": a scheduling ablation
            variant_cfg = cfg
            if ablation and ablation != "oracle":
                upd = dict(item.split("=", 1) for item in ablation.split(","))
                sched = cfg.scheduling.model_validate({**cfg.scheduling.model_dump(), **upd})
                variant_cfg = cfg.model_copy(update={"scheduling": sched})
            oracle = None
            if ablation == "oracle":  # "sync/seer|oracle": the oracle reference instead of Seer's estimate
                oracle, variant_cfg = OracleLongestFirst(workload(cfg.sim), chunk_tokens=cfg.scheduling.chunk_tokens), cfg
            res, _ = run_variant(variant_cfg, name, timeline=timeline_dir is not None and k == 0 and not ablation,
                                 dispatch_policy=oracle)
            f = res.figures
            for key in ("time_s", "rollout_s", "generated_tokens", "trained_tokens", "wasted_tokens", "preemptions",
                        "consume_dropped", "consume_cancelled"):
                acc[key] = acc.get(key, 0.0) + f[key]
            acc["max_version_gap"] = max(acc.get("max_version_gap", 0.0), f["consume_max_version_gap"])
            acc["max_out_of_order"] = max(acc.get("max_out_of_order", 0.0), f["consume_max_out_of_order"])
            acc["utilization"] = acc.get("utilization", 0.0) + f["utilization"] / len(cfgs)
            tails += [b["t100"] - b["t90"] for b in res.batches]
            makespans += [b["t100"] - b["first_start"] for b in res.batches]
            if res.timeline is not None:
                acc_png = res.timeline.gantt(timeline_dir / f"gantt_{v.split('|')[0].replace('/', '_')}_step0.png",
                                             title=f"{v} (simulated, step 0)", step=0)
                out.setdefault("_gantt", {})[v] = str(acc_png)
        acc["rollout_tokens_per_s"] = acc["generated_tokens"] / acc["rollout_s"]
        acc["train_tokens_per_s"] = acc["trained_tokens"] / acc["time_s"]
        acc["tail_s"] = statistics.mean(tails)
        acc["batch_makespan_s"] = statistics.mean(makespans)
        out[v] = acc
    return out


def _cfgs(base: list[str], seeds: list[int], steps: int, extra: list[str] = ()) -> list[Config]:
    return [load_config(None, [*base, f"sim.seed={s}", f"sim.steps={steps}", *extra]) for s in seeds]


# ---------------------------------------------------------------------------------- real engine


def _real_run(model, cfg: Config, variant: str, *, engine_cfg: EngineConfig, train_s: float, timeline: bool):
    consume, dispatch = parse_variant(variant)
    c, d = build_policies(cfg.scheduling, consume, dispatch, batch_size=cfg.sim.prompts, instances=2)
    store = TokenStore(TINY["vocab"], seed=cfg.sim.seed)
    insts: list[EngineInstance] = []
    for i in range(2):
        eng = LLMEngine(model, engine_cfg.model_copy(update={"engine_id": f"engine-{i}"}), eos_token_ids=[TINY["vocab"] - 1],
                        seed=i)
        insts.append(EngineInstance(i, eng, store, migration=cfg.scheduling.migration, peers=insts))
    drv = RolloutDriver(workload(cfg.sim), insts, c, d, steps=cfg.sim.steps, train_s=lambda tokens: train_s,
                        partial_rollout=cfg.scheduling.partial_rollout, timeline=Timeline() if timeline else None)
    t0 = time.perf_counter()
    res = drv.run()
    res.figures["wall_s"] = time.perf_counter() - t0
    return res


def _pool_runs(figs: list[dict]) -> dict:
    """Driver figures of several runs pooled: sums of times and tokens (ratios of sums), mean tail."""
    tot = {k: sum(f[k] for f in figs) for k in ("time_s", "rollout_s", "generated_tokens", "trained_tokens")}
    return {
        "time_s": tot["time_s"],
        "rollout_tokens_per_s": tot["generated_tokens"] / tot["rollout_s"],
        "train_tokens_per_s": tot["trained_tokens"] / tot["time_s"],
        "tail_s": statistics.mean(f["tail_s"] for f in figs),
        "max_version_gap": max(f["consume_max_version_gap"] for f in figs),
    }


def measure_migration(model, contexts: list[int], reps: int = 3) -> list[dict]:
    """Continuing a request on another instance: recompute its context vs copy its KV over."""
    rows = []
    ecfg = EngineConfig(max_batch_size=1, max_seq_len=max(contexts) + 16, prefill_chunk_tokens=max(contexts) + 16)
    g = torch.Generator().manual_seed(7)
    for n in contexts:
        rec, tra = [], []
        for r in range(reps):
            ids = torch.randint(0, TINY["vocab"] - 1, (n,), generator=g).tolist()
            src = LLMEngine(model, ecfg, eos_token_ids=[])
            src.generate([GenerateRequest(ids[:-1], SamplingParams(max_tokens=1, ignore_eos=True, seed=r))])
            req = lambda: GenerateRequest(list(ids), SamplingParams(max_tokens=1, ignore_eos=True, seed=r))
            dst = LLMEngine(model, ecfg, eos_token_ids=[])
            t0 = time.perf_counter()
            dst.generate([req()])
            rec.append(time.perf_counter() - t0)
            dst = LLMEngine(model, ecfg, eos_token_ids=[])
            t0 = time.perf_counter()
            moved = transfer_kv(src, dst, ids[:-1])
            dst.generate([req()])
            tra.append(time.perf_counter() - t0)
            assert moved >= n - 2, (moved, n)
        rows.append({"context": n, "recompute_s": statistics.median(rec), "transfer_s": statistics.median(tra)})
    return rows


def _gateway_path(model, rcfg: Config, reps: int) -> dict:
    """The product path: the gateway's Dispatcher over 2 threaded AsyncEngines in this one process,
    the real workload's requests (lengths forced with ignore_eos), wall clock. Here the two engines
    share the machine's cores (they are not two machines), so this measures what divided rollout
    costs and whether placement still pays, not the cluster-level gain of the driver runs above."""
    import asyncio

    from arborl.engine import AsyncEngine
    from arborl.engine.dispatcher import Dispatcher
    from arborl.scheduling.dispatch import PinnedDispatch

    wl = workload(rcfg.sim)
    g = torch.Generator().manual_seed(0)
    reqs = []
    for gi in range(rcfg.sim.prompts):
        prompt = torch.randint(0, TINY["vocab"] - 1, (rcfg.sim.prompt_tokens,), generator=g).tolist()
        for p in wl.group(gi):
            reqs.append((f"g{gi}", prompt, SamplingParams(max_tokens=p.turns[0].tokens, ignore_eos=True,
                                                          seed=gi * 100 + p.member), f"g{gi}m{p.member}"))

    async def run(n_engines: int, policy) -> tuple[float, dict]:
        engines = [AsyncEngine(LLMEngine(model, EngineConfig(max_batch_size=8, max_seq_len=512, engine_id=f"e{i}"),
                                         eos_token_ids=[TINY["vocab"] - 1], seed=i)) for i in range(n_engines)]
        try:
            d = Dispatcher(engines, policy, migration="transfer")
            t0 = time.perf_counter()
            await asyncio.gather(*(d.generate(GenerateRequest(list(pr), sp, request_id=rid), gid) for gid, pr, sp, rid in reqs))
            return time.perf_counter() - t0, d.stats()
        finally:
            for e in engines:
                e.shutdown()

    chunk = rcfg.scheduling.chunk_tokens
    times: dict[str, list[float]] = {"pinned2": [], "seer2": [], "whole1": [], "pieces1": []}
    stats = {}
    for _ in range(reps):  # alternating, medians
        times["pinned2"].append(asyncio.run(run(2, PinnedDispatch(2)))[0])
        t, stats = asyncio.run(run(2, SeerDispatch(chunk_tokens=chunk)))
        times["seer2"].append(t)
        times["whole1"].append(asyncio.run(run(1, SeerDispatch(chunk_tokens=0)))[0])
        times["pieces1"].append(asyncio.run(run(1, SeerDispatch(chunk_tokens=chunk)))[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds": med, "seer_pieces": stats["pieces"], "requests": stats["requests"],
            "seer_migrations": stats["migrations"], "transferred_tokens": stats["transferred_tokens"]}


# ------------------------------------------------------------------------------------------- run


def run(quick: bool, console: Console) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    figures: dict = {"bench": "scheduling", "quick": quick}

    # 1. calibration ------------------------------------------------------------------------------
    console.print("calibrating the cost model on the built-in engine (tiny Llama 4x256, CPU) ...")
    model = tiny_llama(**TINY)
    dfit, pfit = calibrate(model, TINY["vocab"], batches=(1, 4, 8, 16) if not quick else (1, 4, 8),
                           contexts=(32, 256), prefill_tokens=(32, 128, 512), steps=6 if not quick else 4)
    t = Table(box=box.SIMPLE, title="cost model fit: decode step = a + b*batch + c*context; prefill = p0 + p*tokens")
    for col in ("batch", "context (tokens)", "measured ms", "fit ms"):
        t.add_column(col)
    for b, c, m, p in dfit.points:
        t.add_row(str(b), str(c), f"{m * 1e3:.2f}", f"{p * 1e3:.2f}")
    for n, m, p in pfit.points:
        t.add_row("prefill", str(n), f"{m * 1e3:.2f}", f"{p * 1e3:.2f}")
    console.print(t)
    console.print(f"  decode fit {dfit.params} R2={dfit.r2:.3f} max rel err={dfit.max_rel_err:.3f}")
    console.print(f"  prefill fit {pfit.params} R2={pfit.r2:.3f} max rel err={pfit.max_rel_err:.3f}")
    figures["calibration"] = {"decode": dfit.as_dict(), "prefill": pfit.as_dict()}

    # 2. Seer-like workload -----------------------------------------------------------------------
    seeds = [0] if quick else [0, 1, 2]
    steps = 2
    console.print(f"simulating the Seer-like workload (400 x 8, <= 64K tokens, 32 instances; seeds {seeds}, {steps} steps) ...")
    variants = ["sync/pinned", "sync/seer", "async_ratio/pinned", "windowed_fifo/pinned",
                "sync/seer|context_aware=false", "sync/seer|chunk_tokens=0", "sync/seer|oversample=0.25", "sync/seer|oracle"]
    seer = _pooled(_cfgs(SEER_WORKLOAD, seeds, steps), variants, timeline_dir=OUT_DIR)
    gantt = seer.pop("_gantt", {})
    base = seer["sync/pinned"]
    t = Table(box=box.SIMPLE, title="simulator: Seer-like workload (pooled over seeds)")
    t.add_column("policy", no_wrap=True)
    for col in ("roll x", "tail s", "cut", "train x", "preempt", "gap", "ooo"):
        t.add_column(col, no_wrap=True)
    label = {"sync/seer|context_aware=false": "seer divided only", "sync/seer|chunk_tokens=0": "seer ctx-aware only",
             "sync/seer|oversample=0.25": "seer oversample .25", "sync/seer|oracle": "oracle longest-first"}
    for v, f in seer.items():
        t.add_row(label.get(v, v), f"{f['rollout_tokens_per_s'] / base['rollout_tokens_per_s']:.2f}",
                  f"{f['tail_s']:.0f}", f"{1 - f['tail_s'] / base['tail_s']:.0%}",
                  f"{f['train_tokens_per_s'] / base['train_tokens_per_s']:.2f}", f"{f['preemptions']:.0f}",
                  f"{f['max_version_gap']:.0f}", f"{f['max_out_of_order']:.0f}")
    console.print(t)
    console.print("  roll x / train x: rollout / trained tokens per second vs sync/pinned; tail: 90% -> 100% of a "
                  "step's requests done, cut vs sync/pinned; gap: max version gap of a trained item; ooo: most older "
                  "unfinished items an item was consumed ahead of")
    s = seer["sync/seer"]
    figures["sim_seer_vs_sync_throughput"] = round(s["rollout_tokens_per_s"] / base["rollout_tokens_per_s"], 3)
    figures["sim_seer_tail_reduction"] = round(1 - s["tail_s"] / base["tail_s"], 3)
    figures["sim_seer_divided_only_vs_sync"] = round(
        seer["sync/seer|context_aware=false"]["rollout_tokens_per_s"] / base["rollout_tokens_per_s"], 3)
    figures["sim_seer_context_aware_only_vs_sync"] = round(
        seer["sync/seer|chunk_tokens=0"]["rollout_tokens_per_s"] / base["rollout_tokens_per_s"], 3)
    figures["sim_seerlike_async_vs_sync_throughput"] = round(
        seer["async_ratio/pinned"]["train_tokens_per_s"] / base["train_tokens_per_s"], 3)
    o = seer["sync/seer|oracle"]
    figures["sim_oracle_lfs_vs_sync_throughput"] = round(o["rollout_tokens_per_s"] / base["rollout_tokens_per_s"], 3)
    figures["sim_oracle_lfs_tail_reduction"] = round(1 - o["tail_s"] / base["tail_s"], 3)
    # what bounds the tail: the longest request (max_tokens) decoded alone, from t = 0, on an idle instance
    cfg0 = load_config(None, SEER_WORKLOAD)
    solo = cost_model(cfg0.sim).prefill_s(cfg0.sim.prompt_tokens) + cost_model(cfg0.sim).steps_s(
        1, cfg0.sim.prompt_tokens, cfg0.sim.max_tokens)
    figures["sim_longest_request_alone_s"] = round(solo, 1)
    figures["sim_seer_makespan_s"] = round(s["batch_makespan_s"], 1)
    figures["sim_pinned_makespan_s"] = round(base["batch_makespan_s"], 1)
    figures["sim_seer_oversample25_vs_sync"] = round(
        seer["sync/seer|oversample=0.25"]["rollout_tokens_per_s"] / base["rollout_tokens_per_s"], 3)
    w = math.ceil(0.3 * 400)
    figures["sim_wfifo_max_lag"] = int(seer["windowed_fifo/pinned"]["max_out_of_order"])
    figures["sim_wfifo_window"] = w
    figures["sim_wfifo_max_version_gap"] = int(seer["windowed_fifo/pinned"]["max_version_gap"])
    figures["sim_async_max_version_gap"] = int(seer["async_ratio/pinned"]["max_version_gap"])
    figures["gantt"] = gantt

    # sensitivity of the Seer figures (and the oracle's) to the length distribution: the tail figure
    # moves a lot with it (quick: one seed, one step per workload)
    sens = {}
    for extra in ("sim.length_median=6000", "sim.length_median=16000", "sim.sigma_prompt=0.7", "sim.sigma_prompt=1.3"):
        r = _pooled(_cfgs(SEER_WORKLOAD, seeds, 1, [extra]), ["sync/pinned", "sync/seer", "sync/seer|oracle"])
        b = r["sync/pinned"]
        sens[extra.removeprefix("sim.")] = {
            v.replace("sync/seer|oracle", "oracle").replace("sync/seer", "seer"): {
                "throughput": round(r[v]["rollout_tokens_per_s"] / b["rollout_tokens_per_s"], 3),
                "tail_reduction": round(1 - r[v]["tail_s"] / b["tail_s"], 3),
            }
            for v in ("sync/seer", "sync/seer|oracle")
        }
    t = Table(box=box.SIMPLE, title="Seer and the oracle vs pinned sync on other length distributions")
    for col in ("workload", "seer roll x", "seer tail cut", "oracle roll x", "oracle tail cut"):
        t.add_column(col, no_wrap=True)
    for k, v in sens.items():
        t.add_row(k, f"{v['seer']['throughput']:.2f}", f"{v['seer']['tail_reduction']:.0%}",
                  f"{v['oracle']['throughput']:.2f}", f"{v['oracle']['tail_reduction']:.0%}")
    console.print(t)
    figures["sim_seer_sensitivity"] = sens

    # 3. agentic workload -------------------------------------------------------------------------
    a_seeds = [0] if quick else [0, 1]
    a_steps = 6 if quick else 8
    console.print(f"simulating the agentic workload (64 x 8, <= 8 turns, env latency median 5 s; seeds {a_seeds}, {a_steps} steps) ...")
    agentic = _pooled(_cfgs(AGENTIC_WORKLOAD, a_seeds, a_steps),
                      ["sync/pinned", "async_ratio/pinned", "windowed_fifo/pinned", "async_ratio/seer"])
    ab = agentic["sync/pinned"]
    t = Table(box=box.SIMPLE, title="simulator: agentic workload (pooled over seeds)")
    t.add_column("policy", no_wrap=True)
    for col in ("s/step", "train x", "dropped", "cancelled", "gap", "ooo"):
        t.add_column(col, no_wrap=True)
    for v, f in agentic.items():
        t.add_row(v, f"{f['time_s'] / (a_steps * len(a_seeds)):.0f}", f"{f['train_tokens_per_s'] / ab['train_tokens_per_s']:.2f}",
                  f"{f['consume_dropped']:.0f}", f"{f['consume_cancelled']:.0f}", f"{f['max_version_gap']:.0f}",
                  f"{f['max_out_of_order']:.0f}")
    console.print(t)
    figures["sim_async_vs_sync_throughput"] = round(agentic["async_ratio/pinned"]["train_tokens_per_s"] / ab["train_tokens_per_s"], 3)
    figures["sim_wfifo_vs_sync_throughput"] = round(agentic["windowed_fifo/pinned"]["train_tokens_per_s"] / ab["train_tokens_per_s"], 3)
    figures["sim_agentic_wfifo_max_lag"] = int(agentic["windowed_fifo/pinned"]["max_out_of_order"])
    figures["sim_agentic_wfifo_window"] = math.ceil(0.3 * 64)

    # 4. real engines -----------------------------------------------------------------------------
    console.print("real engines: 2 built-in engine instances (tiny Llama 4x256, CPU), lengths forced with ignore_eos ...")
    groups = 8 if quick else 12
    real_over = ["sim.instances=2", f"sim.prompts={groups}", "sim.group_size=4", "sim.steps=2", "sim.prompt_tokens=32",
                 "sim.length_median=48", "sim.sigma_prompt=0.9", "sim.sigma_member=0.3", "sim.max_tokens=384",
                 "sim.min_tokens=4", "scheduling.chunk_tokens=32", "scheduling.migration=recompute"]
    rcfg = load_config(None, real_over)
    ecfg = EngineConfig(max_batch_size=8, max_seq_len=512)
    train_s = 0.5
    # the workload draw decides how unbalanced pinned groups are (seed 0 happens to be nearly balanced),
    # so the real runs pool several draws, as the simulated ones do
    r_seeds = [0, 1, 2] if quick else [0, 1, 2, 3]
    r_cfgs = [load_config(None, [*real_over, f"sim.seed={sd}"]) for sd in r_seeds]
    real: dict[str, dict] = {}
    for v in ("sync/pinned", "sync/seer", "async_ratio/pinned"):
        runs = [_real_run(model, c, v, engine_cfg=ecfg, train_s=train_s, timeline=(k == 0 and v != "async_ratio/pinned"))
                for k, c in enumerate(r_cfgs)]
        real[v] = f = _pool_runs([r.figures for r in runs])
        tl = runs[0].timeline
        if tl is not None:
            gantt[f"real:{v}"] = str(tl.gantt(OUT_DIR / f"gantt_real_{v.replace('/', '_')}_step0.png",
                                              title=f"{v} (2 real engines, step 0)", step=0))
        console.print(f"  {v}: {f['time_s']:.2f} s engine time over {len(r_seeds)} workload draws, rollout "
                      f"{f['rollout_tokens_per_s']:.0f} tok/s, tail {f['tail_s']:.2f} s")
    # the simulator's prediction for the same workloads, with the calibrated cost model
    cal = CostModel(**dfit.params, **pfit.params, transfer_per_token_s=0.0, kv_capacity_tokens=8 * 512, max_batch=8,
                    weight_update_s=0.0)
    pred: dict[str, dict] = {}
    for v in real:
        figs = []
        for c in r_cfgs:
            cp, dp = build_policies(c.scheduling, *parse_variant(v), batch_size=groups, instances=2)
            drv = RolloutDriver(workload(c.sim), [SimInstance(i, cal, migration="recompute") for i in range(2)], cp, dp,
                                steps=c.sim.steps, train_s=lambda tokens: train_s)
            figs.append(drv.run().figures)
        pred[v] = _pool_runs(figs)
    rb, pb = real["sync/pinned"], pred["sync/pinned"]
    def gain(f: dict, b: dict, v: str) -> float:  # sync variants: rollout throughput; async: trained tokens/s
        k = "train_tokens_per_s" if v.startswith("async") else "rollout_tokens_per_s"
        return f[k] / b[k]

    t = Table(box=box.SIMPLE, title="2 real engines vs the calibrated simulator, same workloads (pooled draws)")
    t.add_column("policy", no_wrap=True)
    for col in ("real s", "real x", "sim s", "sim x", "real tail s", "sim tail s"):
        t.add_column(col, no_wrap=True)
    for v in real:
        t.add_row(v, f"{real[v]['time_s']:.2f}", f"{gain(real[v], rb, v):.2f}", f"{pred[v]['time_s']:.2f}",
                  f"{gain(pred[v], pb, v):.2f}", f"{real[v]['tail_s']:.2f}", f"{pred[v]['tail_s']:.2f}")
    console.print(t)
    figures["real_model"] = "tiny-llama-4x256 (CPU); SmolLM2-135M takes ~150 ms a decode step here, too slow for this bench"
    figures["real_seer_vs_sync_throughput"] = round(real["sync/seer"]["rollout_tokens_per_s"] / rb["rollout_tokens_per_s"], 3)
    figures["real_seer_tail_reduction"] = round(1 - real["sync/seer"]["tail_s"] / rb["tail_s"], 3) if rb["tail_s"] else 0.0
    figures["real_async_vs_sync_throughput"] = round(real["async_ratio/pinned"]["train_tokens_per_s"] / rb["train_tokens_per_s"], 3)
    figures["real_async_max_version_gap"] = int(real["async_ratio/pinned"]["max_version_gap"])
    figures["simpred_real_seer_vs_sync_throughput"] = round(pred["sync/seer"]["rollout_tokens_per_s"] / pb["rollout_tokens_per_s"], 3)
    figures["simpred_real_async_vs_sync_throughput"] = round(pred["async_ratio/pinned"]["train_tokens_per_s"] / pb["train_tokens_per_s"], 3)

    gp = _gateway_path(model, rcfg, reps=2 if quick else 3)
    sec = gp["seconds"]
    console.print(f"  gateway path (Dispatcher, 2 in-process engines sharing the cores, wall clock): pinned "
                  f"{sec['pinned2']:.2f} s, seer {sec['seer2']:.2f} s ({gp['seer_pieces']:.0f} pieces for "
                  f"{gp['requests']:.0f} requests, {gp['seer_migrations']:.0f} migrations); one engine: whole requests "
                  f"{sec['whole1']:.2f} s, in {rcfg.scheduling.chunk_tokens}-token pieces {sec['pieces1']:.2f} s")
    figures["real_gateway_seer_vs_pinned_throughput"] = round(sec["pinned2"] / sec["seer2"], 3)
    figures["real_gateway_piece_overhead"] = round(sec["pieces1"] / sec["whole1"] - 1, 3)
    figures["real_gateway"] = gp

    mig = measure_migration(model, [128, 448] if quick else [64, 128, 256, 448])
    for m in mig:
        console.print(f"  migration, {m['context']} tokens of context: recompute {m['recompute_s'] * 1e3:.1f} ms, "
                      f"transfer {m['transfer_s'] * 1e3:.1f} ms")
    figures["migration"] = mig
    longest = mig[-1]
    figures["migration_transfer_vs_recompute_speedup"] = round(longest["recompute_s"] / longest["transfer_s"], 3)
    figures["migration_winner"] = "transfer" if longest["transfer_s"] < longest["recompute_s"] else "recompute"

    figures["goals"] = {
        "sim_seer_vs_sync_throughput>=1.74": figures["sim_seer_vs_sync_throughput"] >= 1.74,
        "sim_seer_tail_reduction>=0.75": figures["sim_seer_tail_reduction"] >= 0.75,
        "sim_async_vs_sync_throughput>=2.0": figures["sim_async_vs_sync_throughput"] >= 2.0,
        "sim_wfifo_max_lag<=W-1": figures["sim_wfifo_max_lag"] <= w - 1,
        "real_seer_vs_sync_throughput>1": figures["real_seer_vs_sync_throughput"] > 1,
        "real_async_vs_sync_throughput>1": figures["real_async_vs_sync_throughput"] > 1,
    }
    figures["wall_s"] = round(time.perf_counter() - t_start, 1)
    console.print(f"goals: {figures['goals']}")
    return figures
