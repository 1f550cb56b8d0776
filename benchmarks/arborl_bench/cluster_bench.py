"""``arborl bench cluster``: the Ray deployment (cluster.backend=ray) on a local Ray cluster.

1. step time: the tiny job (random 1-layer Llama, SmolLM2 tokenizer, even_tokens, two engines)
   trained in process and with its engines as Ray actors, both built side by side and their steps
   alternated; ``ray_vs_local_step_ratio`` = median over step pairs of (Ray step / the local step just
   before it), the warm-up pair left out; ``rollout_s_*``, ``train_s_*``, ``publish_s_*`` say where a
   step's time goes.
2. faults: the same job on Ray, its episodes in a rollout-worker actor, while an engine actor (step
   1) and the worker actor (step 2) are killed (SIGKILL) at a random moment of a step; the run must
   finish; then ``arborl train`` with the trainer and the gateway in a trainer actor
   (cluster.trainer_restarts=1), killed at a random moment after its first checkpoint (the gateway
   fault: it cannot die alone, see docs/cluster.md), must finish
   from it (``trainer_run_finished_after_kill``); ``episodes_lost`` = episodes left unfinished in the
   data pools and, of the trainer run, episodes finished before the kill that its data pool lacks after, ``calls_lost`` = calls the gateway answered but the data pool lacks (first run); the
   killed engine actor must come back at the current version. ``cluster_startup_s`` = ray.init + placement group + actors ready.
3. weight sync: a ~100 MB policy (tiny Llama, hidden 256) published to two engine actors by each
   method of ``cluster.weight_sync`` (collective: a gloo broadcast here, NCCL on GPUs);
   ``weight_sync_ms_per_100mb_<method>`` = publish + every actor loaded, per 100 MB of weights
   (median of 3; the collective's first version, which forms the group, is one of the 3).
4. PD: one engine decodes 4 long streams while multi-turn prompts of ~400 tokens arrive; colocated,
   the decode engine prefills them itself; with PD the other engine prefills and the KV moves over.
   ``pd_vs_colocated_decode_stall`` = p99 of the gap between a stream's tokens (decode-step latency)
   with PD / colocated (below 1: PD stalls the decode batch less).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from arborl.run.assemble import build_gateway
from arborl.cluster import disaggregate
from arborl.cluster.session import start, stop
from arborl.config import Config, load_config
from arborl.run.controller import Controller
from arborl.models import load_model
from arborl.tasks import make_suite
from arborl.train.trainer import Trainer
from arborl.types import GenerateRequest, SamplingParams
from arborl_bench.figures import figure_table

TINY = ["seed=3", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=1024", "engine.max_batch_size=16", "rollout.task=even_tokens", "rollout.batch_tasks=4",
        "rollout.group_size=4", "rollout.max_tokens=8", "rollout.eval_tasks=0", "train.lr=0.1",
        "scheduling.timeline=false", "gateway.num_engines=2"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def tiny_job(root: Path, name: str, *extra: str) -> Config:
    """The tiny job's config (TINY) in ``root`` under ``name``, with ``extra`` overrides."""
    return load_config(None, [f"runs_dir={root}", f"name={name}", *TINY, *extra])


async def _steps(cfg: Config, built, trainer: Trainer, steps: int, on_step=None) -> tuple[list[float], list[dict]]:
    ctl = Controller(cfg, built.gateway, built.engines, built.pool, trainer, make_suite(cfg.rollout))
    times, rows = [], []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            task = asyncio.ensure_future(ctl.train_step(step))
            if on_step is not None:
                await on_step(step, task, ctl)
            rows.append(await task)
            times.append(time.perf_counter() - t0)
    finally:
        await ctl.close()
    return times, rows


def _build(cfg: Config, run_dir: Path):
    loaded = load_model(cfg.model)
    trainer = Trainer(loaded.model, cfg.train, temperature=cfg.rollout.temperature)
    built = build_gateway(cfg, loaded=dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).eval()), run_dir=run_dir)
    return built, trainer


def _step_times(root: Path, steps: int) -> dict[str, Any]:
    """Both deployments side by side, their steps alternated (local, ray, local, ray, ...): a step on
    Ray is compared with the local step just before it, so load from other processes on the machine
    hits both alike. The ratio is the median of the per-pair ratios (the warm-up pair left out)."""
    cfgs = {b: tiny_job(root, f"steps-{b}", f"cluster.backend={b}") for b in ("local", "ray")}
    built: dict[str, Any] = {}
    try:
        for b, cfg in cfgs.items():
            built[b] = _build(cfg, root / f"steps-{b}")
        times, parts = asyncio.run(_alternate(cfgs, built, steps))
    finally:
        for b in built.values():
            b[0].close()
    ratios = [r / lo for lo, r in zip(times["local"][1:], times["ray"][1:])]
    out: dict[str, Any] = {b: statistics.mean(times[b][1:]) for b in times}
    out["ratio"] = statistics.median(ratios)
    for b in parts:  # where a step's time goes, per deployment
        for k in ("rollout_s", "train_s", "publish_s"):
            out[f"{k}_{b}"] = statistics.mean(r[k] for r in parts[b][1:])
    return out


async def _alternate(cfgs: dict[str, Config], built: dict[str, Any], steps: int):
    ctls = {b: Controller(cfgs[b], g.gateway, g.engines, g.pool, t, make_suite(cfgs[b].rollout))
            for b, (g, t) in built.items()}
    times: dict[str, list[float]] = {b: [] for b in ctls}
    rows: dict[str, list[dict]] = {b: [] for b in ctls}
    try:
        for step in range(steps):
            for b, ctl in ctls.items():
                t0 = time.perf_counter()
                rows[b].append(await ctl.train_step(step))
                times[b].append(time.perf_counter() - t0)
    finally:
        for ctl in ctls.values():
            await ctl.close()
    return times, rows


def _faults(root: Path, steps: int, rng: random.Random) -> dict[str, Any]:
    # episodes in one rollout-worker actor (no CPU reserved: the two engines hold the local cluster's)
    cfg = tiny_job(root, "faults", "cluster.backend=ray", "rollout.infra_retries=3", "rollout.workers=1",
               "cluster.worker_cpus=0")
    t0 = time.perf_counter()
    built, trainer = _build(cfg, root / "faults")
    startup = time.perf_counter() - t0
    victim = built.engines.engines[rng.randrange(2)]
    killed: list[str] = []

    async def inject(step: int, task: asyncio.Future, ctl: Controller) -> None:
        if step not in (1, 2):
            return
        # once the step's first engine requests are out, every engine stops decoding between two steps:
        # the kill then lands mid-rollout with requests in flight, however fast the machine is (a timed
        # moment missed the rollout on a faster machine and injected fewer faults)
        start = built.gateway.stats.requests
        while built.gateway.stats.requests < start + rng.randint(1, 4) and not task.done():
            await asyncio.sleep(0.002)
        if task.done():
            return
        engines = [e for e in built.engines.engines if not e.closed]  # the victim of step 1 may still be restarting
        await asyncio.gather(*(e.pause() for e in engines))
        if step == 1:  # an engine actor
            killed.append("engine")
            os.kill(victim.pid, signal.SIGKILL)
        elif ctl.workers is not None and ctl.workers.pids():  # the rollout worker actor
            killed.append("worker")
            os.kill(ctl.workers.pids()[0], signal.SIGKILL)
        for e in engines:
            if not (step == 1 and e is victim):
                e.resume()

    try:
        times, rows = asyncio.run(_steps(cfg, built, trainer, steps, inject))

        async def back() -> dict:
            deadline = time.monotonic() + 120
            while victim.down and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return await victim.actor.info.remote()

        info = asyncio.run(back())
        episodes = built.pool.episodes()
        recorded = sum(len(e.calls) for e in episodes)
        answered = built.gateway.stats.calls_recorded
        return {
            "cluster_startup_s": round(startup, 2),
            "faults_injected": len(killed),
            "faults_killed": "+".join(killed),
            "steps_finished": len(rows),
            "episodes_lost": sum(e.status.value == "running" for e in episodes),
            "calls_lost": answered - recorded,
            "infra_retries": int(rows[-1].get("rollout/infra_failures", 0)) if rows else 0,
            "rejoined_at_current_version": bool(info["version"] == max(e.version for e in built.engines.engines)
                                                and not victim.down),
        }
    finally:
        built.close()


def killed_run(cfg: Config, rng: random.Random, victim: Callable[[], int | None]) -> dict[str, Any]:
    """``arborl train`` with ``cfg`` (cluster.trainer_restarts >= 1, rollout.checkpoint_every=1, 3 steps):
    once its first checkpoint is written, at a random moment of the steps left, the process ``victim()``
    names is SIGKILLed; the run must finish from the checkpoint. ``episodes_lost``: episodes committed
    (finished) before the kill that the data pool lacks afterwards, plus episodes left running."""
    import io
    import sqlite3
    import threading

    from arborl.run import job
    from arborl.run.rundir import RunDir

    run = RunDir(cfg.run_dir, cfg.datapool)
    out: dict[str, Any] = {}

    def train() -> None:
        try:
            out["summary"] = job.train(cfg, console=Console(file=io.StringIO()))
        except Exception as e:  # noqa: BLE001 - reported in the figures
            out["error"] = repr(e)

    def finished() -> set[str]:
        with sqlite3.connect(run.datapool_file) as db:
            return {row[0] for row in db.execute("select episode_id from episodes where status = 'finished'")}

    t = threading.Thread(target=train, daemon=True)
    t.start()
    while not run.has_checkpoint() and t.is_alive():
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.1))  # a random moment of the two steps left
    killed, committed = 0, set()
    pid = victim() if t.is_alive() else None
    if pid is not None:
        committed = finished()
        os.kill(pid, signal.SIGKILL)
        killed = 1
    t.join()
    with sqlite3.connect(run.datapool_file) as db:
        running = db.execute("select count(*) from episodes where status = 'running'").fetchone()[0]
    return {"killed": killed, "finished": "summary" in out and out["summary"]["steps"] == 3,
            "episodes_lost": len(committed - finished()) + running, **({"error": out["error"]} if "error" in out else {})}


def _trainer_fault(root: Path, rng: random.Random) -> dict[str, Any]:
    """``arborl train`` with the trainer (and the gateway) in a trainer actor (cluster.trainer_restarts=1),
    SIGKILLed at a random moment after its first checkpoint; the run must finish from that checkpoint."""
    import ray

    from arborl.cluster.supervise import actor_name

    cfg = tiny_job(root, "trainer-fault", "cluster.backend=ray", "cluster.trainer_restarts=1", "cluster.trainer_cpus=0",
                   "rollout.steps=3", "rollout.checkpoint_every=1")
    return killed_run(cfg, rng, lambda: ray.get(ray.get_actor(actor_name(cfg, 0)).pid.remote()))


def _weight_sync(root: Path) -> dict[str, float]:
    cfg = tiny_job(root, "ws", "cluster.backend=ray", "model.tiny_hidden=256", "model.tiny_layers=2")
    built, trainer = _build(cfg, root / "ws")
    out = {}
    try:
        state = trainer.engine_state()
        mb = sum(v.numel() * v.element_size() for v in state.values()) / 1e6
        dep = built.cluster
        for method in ("object_store", "safetensors", "collective"):
            from arborl.cluster.weights import WEIGHT_SYNC

            dep.use_sync(WEIGHT_SYNC.get(method)(root / "ws" / "weights"))
            ms = []
            for rep in range(3):
                v = {"object_store": 10, "safetensors": 20, "collective": 30}[method] + rep
                s = {k: t.clone() for k, t in state.items()}
                t0 = time.perf_counter()
                asyncio.run(built.engines.update_weights(s, v))
                ms.append((time.perf_counter() - t0) * 1000)
            out[f"weight_sync_ms_per_100mb_{method}"] = round(statistics.median(ms) * 100 / mb, 1)
        out["weight_sync_mb"] = round(mb, 1)
    finally:
        built.close()
    return out


async def _decode_gaps(decode, prefill_via, prompts: list[list[int]]) -> list[float]:
    """Token gaps of 4 long greedy streams on ``decode`` while ``prompts`` arrive through ``prefill_via``."""
    gaps: list[float] = []

    async def streamer(i: int) -> None:
        last = None
        req = GenerateRequest([7 + i, 8, 9], SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True))
        async for t, _ in decode.stream_timed(req):
            if last is not None:
                gaps.append(t - last)
            last = t

    async def turns() -> None:
        await asyncio.sleep(0.3)
        for p in prompts:
            await prefill_via.generate(GenerateRequest(p, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
            await asyncio.sleep(0.05)

    await asyncio.gather(*(streamer(i) for i in range(4)), turns())
    return gaps


def _pd(root: Path, turns: int) -> dict[str, float]:
    cfg = tiny_job(root, "pd", "cluster.backend=ray", "engine.prefix_cache_tokens=65536", "engine.max_seq_len=4096")
    built, _ = _build(cfg, root / "pd")
    out = {}
    try:
        prefill, decode = built.engines.engines
        rng = random.Random(0)
        convo = [rng.randrange(100, 40000) for _ in range(400)]
        prompts = []
        for t in range(turns):  # each turn extends the conversation (tool output), ~400 new tokens
            prompts.append(list(convo))
            convo = convo + [rng.randrange(100, 40000) for _ in range(400)]
        pd = disaggregate([prefill, decode], 1)[0]
        colo = asyncio.run(_decode_gaps(decode, decode, [[1] + p for p in prompts]))
        disagg = asyncio.run(_decode_gaps(decode, pd, [[2] + p for p in prompts]))
        out["decode_step_p99_ms_colocated"] = round(_pct(colo, 0.99) * 1000, 2)
        out["decode_step_p99_ms_pd"] = round(_pct(disagg, 0.99) * 1000, 2)
        out["pd_vs_colocated_decode_stall"] = round(_pct(disagg, 0.99) / _pct(colo, 0.99), 3)
    finally:
        built.close()
    return out


def run(quick: bool, console: Console) -> dict[str, Any]:
    rng = random.Random(0)
    ccfg = tiny_job(Path("."), "x").cluster.model_copy(update={"num_cpus": max(2, os.cpu_count() or 2)})
    t0 = time.perf_counter()
    started = start(ccfg)
    init_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="arborl-cluster-bench-") as tmp:
            root = Path(tmp)
            steps = _step_times(root, 6 if quick else 12)
            faults = _faults(root, 3 if quick else 5, rng)
            faults["cluster_startup_s"] = round(faults["cluster_startup_s"] + init_s, 2)
            tf = _trainer_fault(root, rng)
            faults["faults_injected"] += tf["killed"]
            faults["faults_killed"] += "+trainer+gateway" * tf["killed"]  # the gateway is an object of the trainer's process
            faults["episodes_lost"] += tf["episodes_lost"]
            faults["trainer_run_finished_after_kill"] = tf["finished"]
            ws = _weight_sync(root)
            pd = _pd(root, 4 if quick else 8)
    finally:
        stop(started)
    result = {
        "ray_vs_local_step_ratio": round(steps["ratio"], 3),
        "step_s_local": round(steps["local"], 3),
        "step_s_ray": round(steps["ray"], 3),
        **{k: round(v, 3) for k, v in steps.items() if k.startswith(("rollout_s_", "train_s_", "publish_s_"))},
        **ws, **faults, **pd,
        "ray_init_s": round(init_s, 2),
        "quick": quick,
    }
    console.print(figure_table("arborl bench cluster (local Ray cluster)", result))
    return result
