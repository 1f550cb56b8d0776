"""``arborl bench progress [--quick]``: training progress per hour on the code-repair job, lever by lever.

Every configuration is the real job (``configs/code_repair.yaml``: SmolLM2-135M, the bubblewrap sandbox,
LoRA GRPO) started as a user starts it (``arborl train``, one process per run) from one shared SFT
checkpoint, so the runs differ only in their RL. The SFT checkpoint comes from ``ARBORL_PROGRESS_SFT``
(a ``checkpoint-sft`` directory of an earlier run of the job), else from ``runs/bench-progress/sft``, which
the bench writes once by running the job's warm start (about 15 minutes here) and reuses afterwards.

Per run it reads metrics.jsonl and summary.json: held-out greedy success on both splits (before RL, every
``rollout.eval_every`` steps, after) against the training wall-clock (the sum of the steps' times: evaluation
excluded) and against rollout tokens, rollout tokens/s, each step's time split (rollout -- the episodes,
sandbox and reward included --, train, weight publish, and the rest), the speculative acceptance length,
the train/rollout mismatch (``mismatch_k3_kl``: the steps' mean ``mismatch/k3_kl``, the k3 estimate of
KL(rollout || train) over the loss tokens, what a low-precision rollout costs), the tree packing's saving
(``packed_over_flat``: the tokens the training forwards computed packed over those they would have flat, all
steps together), the staleness the trainer saw (``version_gap_mean`` / ``version_gap_max``: each step's
largest policy-version gap of its episodes, ``sched/max_version_gap``, averaged / at most; 0 when
synchronous), and the peak resident memory of the run's process tree (psutil, sampled every second); a
figure whose metric the run did not log is None. Then the suffix drafter's variants are replayed on the
baseline's own recorded generations (``replay_acceptance``): their expected acceptance length under the SFT
policy, paired on the same texts.

Configurations (each a set of ``--set`` overrides on the job's config): ``baseline`` (the job as configured),
one per lever (``LEVERS``: speculative decoding, asynchronous and dynamic consumption, partial credit, the
rollout's weights in bf16 -- ``bf16_rollout`` without a correction, ``bf16_rollout_tis`` with the trainer's TIS
-- or in int8 with TIS, ``int8_rollout``), and ``stack`` (spec, async and partial credit together). The target
is the baseline's mean final held-out success; ``time_to_target_ratio`` is the stack's mean time to its first
evaluation at or above it over the baseline's.

``--quick``: the baseline and the stack, one seed each, 4 RL steps, evaluated before and after: it points the
way (is the stack faster per step, does it still learn) in about 20 minutes, and its time-to-target compares
only final points. The full run: 3 seeds of the baseline and the stack, one of each lever, 16 steps,
evaluated every 4.

The simulator, calibrated on the baseline's own trace and the engine's measured costs (``progress_sim``),
predicts each configuration's step time (``sim_step_time``: predicted, measured, relative error per
configuration; ``sim_step_time_max_rel_err``). It does not know what a lever does to the trainer's work (partial
credit trains more samples) or to the cores the trainer and engine share.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

JOB = "configs/code_repair.yaml"
RUNS = Path("runs/bench-progress")

SPEC = ["engine.spec.enabled=true", "engine.spec.prompt_lookup=true"]
ASYNC = ["scheduling.consume=async_ratio", "scheduling.async_ratio=1"]
PARTIAL = ["train.advantage.shaping.component_weights={tests_passed_frac: 0.5}"]
LEVERS: dict[str, list[str]] = {
    "spec": SPEC,
    "async": ASYNC,
    "dynamic": ["scheduling.consume=dynamic"],
    "partial_credit": PARTIAL,
    "bf16_rollout": ["engine.weights_dtype=bfloat16"],
    "bf16_rollout_tis": ["engine.weights_dtype=bfloat16", "train.correction.mode=tis"],
    "int8_rollout": ["engine.weights_dtype=int8", "train.correction.mode=tis"],
}
STACK = SPEC + ASYNC + PARTIAL


def configurations(quick: bool, only: str = "", seeds: str = "") -> list[tuple[str, list[str], int]]:
    """(name, overrides, seed) of every run, in the order they run. ``only`` (``ARBORL_PROGRESS_ONLY``): a
    comma-separated choice among the stack and the levers, run beside the baseline, each with the seeds of
    ``seeds`` (``ARBORL_PROGRESS_SEEDS``, comma-separated; default 0)."""
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        known = {"stack": STACK, **LEVERS}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"ARBORL_PROGRESS_ONLY: unknown configuration(s) {unknown}; choose from {sorted(known)}")
        picked = [int(x) for x in seeds.split(",") if x.strip()] or [0]
        return [(n, [] if n == "baseline" else known[n], s) for s in picked for n in ["baseline", *names]]
    seeds_ = [0] if quick else [0, 1, 2]
    runs = [("baseline", [], s) for s in seeds_] + [("stack", STACK, s) for s in seeds_]
    if not quick:
        runs += [(name, over, 0) for name, over in LEVERS.items()]
    return runs


class TreePeak:
    """The largest resident memory of a process and its descendants, sampled every ``period_s``."""

    def __init__(self, pid: int, period_s: float = 1.0) -> None:
        import psutil

        self.proc, self.period_s, self.peak = psutil.Process(pid), period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            try:
                for p in [self.proc, *self.proc.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            self.peak = max(self.peak, total)
            self._stop.wait(self.period_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def arborl(*args: str, log: Path) -> tuple[int, int]:
    """Run ``arborl ARGS`` (output to ``log``); (exit status, peak resident bytes of its process tree)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "arborl.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        peak = TreePeak(proc.pid)
        code = proc.wait()
    return code, peak.stop()


def sets(items: list[str]) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def sft_checkpoint(console) -> Path:
    """The shared SFT checkpoint (module docstring)."""
    given = os.environ.get("ARBORL_PROGRESS_SFT")
    if given:
        path = Path(given)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"ARBORL_PROGRESS_SFT={given} is not a model directory (no config.json)")
        return path
    path = RUNS / "sft" / "checkpoint-sft"
    if (path / "config.json").is_file():
        return path
    console.print("the job's SFT warm start, once (its checkpoint is shared by every run) ...")
    RUNS.mkdir(parents=True, exist_ok=True)
    code, _ = arborl("train", JOB, *sets([f"runs_dir={RUNS}", "name=sft", "rollout.steps=0"]), "--overwrite",
                     log=RUNS / "sft.log")
    if code != 0 or not (path / "config.json").is_file():
        raise RuntimeError(f"the SFT warm start failed ({code}): see {RUNS / 'sft.log'}")
    return path


def run_one(name: str, overrides: list[str], seed: int, sft: Path, steps: int, eval_every: int) -> dict[str, Any]:
    run_name = f"{name}-s{seed}"
    base = [f"runs_dir={RUNS}", f"name={run_name}", f"seed={seed}", "model.source=hf", f"model.path={sft}",
            "train.sft.files=[]", "train.sft.rejection.rounds=0", f"rollout.steps={steps}",
            f"rollout.eval_every={eval_every}", "report.curves=false"]
    t0 = time.perf_counter()
    code, peak = arborl("train", JOB, *sets(base + overrides), "--overwrite", log=RUNS / f"{run_name}.log")
    wall = time.perf_counter() - t0
    run_dir = RUNS / run_name
    if code != 0:
        raise RuntimeError(f"{run_name} failed ({code}): see {RUNS / (run_name + '.log')}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return summarise(name, seed, rows, peak, wall)


def summarise(name: str, seed: int, rows: list[dict], peak: int, wall: float) -> dict[str, Any]:
    """One run's figures from its metrics rows."""
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    elapsed, tokens, at = 0.0, 0, {0: (0.0, 0)}
    for r in steps:
        elapsed += r["step_s"]
        tokens += r["generated_tokens"]
        at[r["step"]] = (elapsed, tokens)
    curve = {split: [(e["step"], *at.get(e["step"], (elapsed, tokens)), e["eval_success"])
                     for e in evals if e.get("split") == split] for split in ("eval", "eval_perturbed")}
    split = {k: sum(r.get(k, 0.0) for r in steps) for k in ("rollout_s", "train_s", "publish_s", "step_s")}
    split["other_s"] = split["step_s"] - split["rollout_s"] - split["train_s"] - split["publish_s"]
    gen_s = sum(r["generated_tokens"] / r["rollout_tokens_per_s"] for r in steps if r.get("rollout_tokens_per_s"))
    spec = [r["spec/spec_mean_acceptance_length"] for r in steps if r.get("spec/spec_mean_acceptance_length")]
    first = {s: (c[0][3] if c else None) for s, c in curve.items()}
    final = {s: (c[-1][3] if c else None) for s, c in curve.items()}
    k3 = [r["mismatch/k3_kl"] for r in steps if r.get("mismatch/k3_kl") is not None]
    packed = [(r["train/packed_tokens"], r["train/flat_tokens"]) for r in steps
              if r.get("train/packed_tokens") is not None and r.get("train/flat_tokens")]
    gap = [r["sched/max_version_gap"] for r in steps if r.get("sched/max_version_gap") is not None]
    return {"config": name, "seed": seed, "curve": curve, "train_wall_s": round(elapsed, 1), "run_wall_s": round(wall, 1),
            "rollout_tokens": tokens, "rollout_tokens_per_s": round(tokens / gen_s, 1) if gen_s else None,
            "time_split_s": {k: round(v, 1) for k, v in split.items()},
            "step_s_mean": round(split["step_s"] / max(1, len(steps)), 1),
            "spec_acceptance_length": round(sum(spec) / len(spec), 3) if spec else None,
            "mismatch_k3_kl": sum(k3) / len(k3) if k3 else None,
            "packed_over_flat": round(sum(p for p, _ in packed) / sum(f for _, f in packed), 4) if packed else None,
            "version_gap_mean": round(sum(gap) / len(gap), 3) if gap else None,
            "version_gap_max": max(gap) if gap else None,
            "success_before": first, "success_final": final, "peak_rss_gb": round(peak / 1e9, 2)}


def time_to(run: dict[str, Any], target: float) -> float | None:
    """Training seconds to the run's first held-out evaluation at or above ``target`` (None: never)."""
    for step, secs, _tokens, success in run["curve"]["eval"]:
        if step > 0 and success >= target - 1e-9:
            return secs
    return None


def replay_acceptance(run_dir: Path, policy: Path, calls: int, k: int = 6, temperature: float = 0.5) -> dict[str, Any]:
    """Expected acceptance length (1 + E[accepted tokens] per drafting position, under the policy's own
    probabilities) of the suffix drafter's variants on the job's recorded generations: ``calls`` model calls
    drawn from ``run_dir``'s data pool, each replayed token by token. ``self``: the call's own tokens so far
    (vote); ``group``: with the same turn's call of every other member of its group; ``+lookup``: prompt
    lookup's path beside the vote. Paired: every variant drafts at the same positions of the same texts."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from arborl.config import SpecConfig
    from arborl.datapool import DataPool
    from arborl.engine.model_runner import ModelRunner
    from arborl.engine.specdec.draft import Draft
    from arborl.engine.specdec.suffix import TokenStore, lookup_path, suffix_paths
    from arborl.engine.specdec.verify import sampling_logprobs
    from arborl.types import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    with DataPool(run_dir / "datapool.sqlite") as pool:
        episodes = pool.episodes(with_calls=True)
    groups: dict[str, list] = {}
    for e in episodes:
        groups.setdefault(e.group_id, []).append(e)
    picked = [(e, i, c) for e in episodes for i, c in enumerate(e.calls) if c.completion_token_ids]
    random.Random(0).shuffle(picked)
    cfg, params = SpecConfig(), SamplingParams(temperature=temperature)
    runner = ModelRunner(model, slots=1, max_len=16384)
    variants = ("self", "self+lookup", "group", "group+lookup")
    total, positions = dict.fromkeys(variants, 0.0), 0
    for e, turn, call in picked[:calls]:
        prompt, stream = call.prompt_token_ids, call.prompt_token_ids + call.completion_token_ids
        own, grp = TokenStore(cfg.min_match), TokenStore(cfg.min_match)
        for sib in groups[e.group_id]:
            if sib.episode_id != e.episode_id and len(sib.calls) > turn:
                sc = sib.calls[turn]
                grp.extend(sib.episode_id, sc.prompt_token_ids + sc.completion_token_ids, len(sc.prompt_token_ids))
        start = len(prompt) + 1  # the first token comes from the prefill
        own.extend("me", stream[:start], len(prompt))
        grp.extend("me", stream[:start], len(prompt))
        tokens, parents, drafts = list(stream), list(range(-1, len(stream) - 1)), []
        for n in range(start, len(stream)):
            positions += 1
            for v in variants:
                paths = suffix_paths(own if v.startswith("self") else grp, stream[:n], k, cfg, 1)
                if v.endswith("lookup"):
                    extra = lookup_path(own, stream[:n], k, cfg.max_match)
                    if extra and not any(p[: len(extra)] == extra for p in paths):
                        paths.append(extra)
                d = Draft.from_paths(paths)
                drafts.append((v, len(tokens), d))
                tokens += d.tokens
                parents += [n - 1 if q < 0 else len(tokens) - len(d) + q for q in d.parents]
            own.extend("me", stream[n : n + 1])
            grp.extend("me", stream[n : n + 1])
        logp = sampling_logprobs(runner.verify([(0, 0, tokens, parents)])[0, : len(tokens)].float(), params)
        for v, off, d in drafts:
            reach: list[float] = []
            for i, (tok, q) in enumerate(zip(d.tokens, d.parents)):
                reach.append(float(logp[parents[off + i], tok].exp()) * (reach[q] if q >= 0 else 1.0))
            total[v] += sum(reach)
    return {v: round(1 + t / max(1, positions), 3) for v, t in total.items()} | {"positions": positions,
                                                                                  "calls": min(calls, len(picked))}


def simulated_step_times(sft: Path, results: list[dict[str, Any]], configs: list[tuple[str, list[str], int]],
                         trace: Path) -> dict:
    """Each configuration's step time as the simulator predicts it, calibrated on the baseline's trace and on
    the engine's measured decode and prefill costs (a bf16 engine for the bf16 rollout), against the mean
    measured one (``progress_sim``); ``trace``: the baseline run calibrated on."""
    import torch
    from transformers import AutoModelForCausalLM

    from arborl.models.quantize import to_serving_dtype
    from arborl.sim.calibrate import calibrate

    from arborl_bench.progress_sim import component_weights_of, predict, sim_knobs, variant_of

    model = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32).eval()
    fits: dict[str, dict[str, float]] = {}

    def fit(dtype: str) -> dict[str, float]:
        if dtype not in fits:
            m = model if dtype == "float32" else to_serving_dtype(copy.deepcopy(model), dtype)
            dec, pre = calibrate(m, model.config.vocab_size, contexts=(256, 1024), prefill_tokens=(128, 512, 1024))
            fits[dtype] = {**dec.params, **pre.params}
        return fits[dtype]

    overrides = {name: over for name, over, _ in configs}
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["config"] for r in results):
        over = overrides[name]
        dtype = next((o.split("=", 1)[1] for o in over if o.startswith("engine.weights_dtype=")), "float32")
        accept = [r["spec_acceptance_length"] for r in results if r["config"] == name and r["spec_acceptance_length"]]
        # per-position acceptance p from the mean acceptance length 1 + p + p^2 + ... (k = 4), solved numerically
        p = _per_position(sum(accept) / len(accept), 4) if accept else None
        variant, sched, extra = variant_of(name, over, p)
        knobs = {**sim_knobs(trace, fit(dtype), max_batch=32, component_weights=component_weights_of(over)), **extra}
        predicted = predict(knobs, variant, sched)
        measured = sum(r["step_s_mean"] for r in results if r["config"] == name) / sum(r["config"] == name for r in results)
        out[name] = {"predicted_s": round(predicted, 1), "measured_s": round(measured, 1),
                     "rel_err": round(abs(predicted - measured) / measured, 3)}
    return out


def _per_position(length: float, k: int) -> float:
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1 + sum(mid**i for i in range(1, k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return lo


def mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else 0.0
    return m, se


def run(quick: bool, console) -> dict:
    from rich.table import Table

    RUNS.mkdir(parents=True, exist_ok=True)
    sft = sft_checkpoint(console)
    steps, every = (4, 0) if quick else (16, 4)
    results: list[dict[str, Any]] = []
    configs = configurations(quick, os.environ.get("ARBORL_PROGRESS_ONLY", ""), os.environ.get("ARBORL_PROGRESS_SEEDS", ""))
    for name, over, seed in configs:
        console.print(f"{name} (seed {seed}): {' '.join(over) or 'the job as configured'} ...")
        results.append(run_one(name, over, seed, sft, steps, every))
        (RUNS / "results.json").write_text(json.dumps(results, indent=1))
    by = {}
    for r in results:
        by.setdefault(r["config"], []).append(r)
    base, stack = by["baseline"], by.get("stack", [])
    target = mean_se([r["success_final"]["eval"] for r in base])[0]
    table = Table(title=f"code-repair RL from one SFT checkpoint, {steps} steps (target: baseline's final {target:.3f})")
    for col in ("config", "seeds", "final eval", "final perturbed", "step s", "rollout tok/s", "accept len",
                "time split (rollout/train/publish/other s)", "time to target s", "mismatch k3 KL", "packed/flat",
                "version gap (step mean)", "peak GB"):
        table.add_column(col)
    for name, rs in by.items():
        sp = {k: sum(r["time_split_s"][k] for r in rs) / len(rs) for k in ("rollout_s", "train_s", "publish_s", "other_s")}
        ttt = [time_to(r, target) for r in rs]
        acc = [r["spec_acceptance_length"] for r in rs if r["spec_acceptance_length"]]
        seen = lambda key, fmt: ", ".join("-" if r[key] is None else fmt % r[key] for r in rs)  # noqa: E731
        table.add_row(name, str(len(rs)), "%.3f" % mean_se([r["success_final"]["eval"] for r in rs])[0],
                      "%.3f" % mean_se([r["success_final"]["eval_perturbed"] for r in rs])[0],
                      "%.1f" % (sum(r["step_s_mean"] for r in rs) / len(rs)),
                      "%.1f" % (sum(r["rollout_tokens_per_s"] or 0 for r in rs) / len(rs)),
                      "%.2f" % (sum(acc) / len(acc)) if acc else "-",
                      "/".join("%.0f" % sp[k] for k in ("rollout_s", "train_s", "publish_s", "other_s")),
                      ", ".join("-" if t is None else "%.0f" % t for t in ttt),
                      seen("mismatch_k3_kl", "%.2e"), seen("packed_over_flat", "%.3f"),
                      seen("version_gap_mean", "%.2f"),
                      "%.2f" % max(r["peak_rss_gb"] for r in rs))
    console.print(table)
    trace = RUNS / f"baseline-s{base[0]['seed']}"
    replay = replay_acceptance(trace, sft, calls=10 if quick else 30)
    sims = simulated_step_times(sft, results, configs, trace)
    console.print(f"simulated step time (calibrated on {trace.name}) against measured: {sims}")
    console.print(f"acceptance length of the suffix drafter's variants on the baseline's own generations (k = 6): {replay}")
    gains = [r["success_final"]["eval"] - r["success_before"]["eval"] for r in base]
    base_t = [time_to(r, target) for r in base]
    stack_t = [time_to(r, target) for r in stack]
    reached = [t for t in stack_t if t is not None]
    ratio = (sum(reached) / len(reached)) / (sum(t for t in base_t if t is not None) / max(1, sum(t is not None for t in base_t))) \
        if reached and len(reached) == len(stack_t) and any(t is not None for t in base_t) else None
    tps = lambda rs: sum(r["rollout_tokens_per_s"] or 0 for r in rs) / len(rs) if rs else 0.0  # noqa: E731
    step = lambda rs: sum(r["step_s_mean"] for r in rs) / len(rs)  # noqa: E731
    acc = [r["spec_acceptance_length"] for r in stack if r["spec_acceptance_length"]]
    return {
        "steps": steps, "seeds_baseline": len(base), "seeds_stack": len(stack), "target_success": round(target, 3),
        "time_to_target_ratio": round(ratio, 3) if ratio is not None else None,
        "stack_reached_target": sum(t is not None for t in stack_t),
        "step_time_ratio": round(step(stack) / step(base), 3) if stack else None,
        "rollout_tokens_per_s_ratio": round(tps(stack) / tps(base), 3) if stack and tps(base) else None,
        "spec_acceptance_length": round(sum(acc) / len(acc), 3) if acc else None,
        "spec_replay_acceptance": replay,
        "sim_step_time_max_rel_err": max((v["rel_err"] for v in sims.values()), default=None),
        "sim_step_time": sims,
        "baseline_rl_gain_mean": round(mean_se(gains)[0], 3), "baseline_rl_gain_se": round(mean_se(gains)[1], 3),
        "stack_final_success_mean": round(mean_se([r["success_final"]["eval"] for r in stack])[0], 3) if stack else None,
        "baseline_final_success_mean": round(target, 3),
        "baseline_final_success_se": round(mean_se([r["success_final"]["eval"] for r in base])[1], 3),
        "peak_rss_gb": max(r["peak_rss_gb"] for r in results),
        "step_time_ratio_by_config": {name: round(step(rs) / step(base), 3) for name, rs in by.items()},
        "configs": {name: [{k: r[k] for k in ("seed", "success_final", "step_s_mean", "rollout_tokens_per_s",
                                              "spec_acceptance_length", "time_split_s", "mismatch_k3_kl",
                                              "packed_over_flat", "version_gap_mean", "version_gap_max",
                                              "peak_rss_gb")} for r in rs]
                    for name, rs in by.items()},
    }
