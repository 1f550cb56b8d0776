"""``arborl bench cluster``: the Ray deployment (cluster.backend=ray) on a local Ray cluster.

1. step time: the tiny job (random 1-layer Llama, SmolLM2 tokenizer, even_tokens, two engines)
   trained in process and with its engines as Ray actors; ``ray_vs_local_step_ratio`` = mean step
   time on Ray / in process (the first step, which warms up, left out).
2. faults: the same job on Ray while an engine actor is killed (SIGKILL) at a random moment of a
   step; the run must finish; ``episodes_lost`` = episodes left unfinished in the data pool,
   ``calls_lost`` = calls the gateway answered but the data pool lacks; the killed actor must come
   back at the current version. ``cluster_startup_s`` = ray.init + placement group + actors ready.
3. weight sync: a ~100 MB policy (tiny Llama, hidden 256) published to two engine actors by each
   method of ``cluster.weight_sync``; ``weight_sync_ms_per_100mb_<method>`` = publish + every actor
   loaded, per 100 MB of weights (median of 3).
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
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from arborl.assemble import build_gateway
from arborl.cluster import disaggregate
from arborl.cluster.session import start, stop
from arborl.config import Config, load_config
from arborl.controller import Controller
from arborl.models import load_model
from arborl.tasks import make_suite
from arborl.train.trainer import Trainer
from arborl.types import GenerateRequest, SamplingParams

TINY = ["seed=3", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=1024", "engine.max_batch_size=16", "rollout.task=even_tokens", "rollout.batch_tasks=4",
        "rollout.group_size=4", "rollout.max_tokens=8", "rollout.eval_tasks=0", "train.lr=0.1",
        "scheduling.timeline=false", "gateway.num_engines=2"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _cfg(root: Path, name: str, *extra: str) -> Config:
    return load_config(None, [f"runs_dir={root}", f"name={name}", *TINY, *extra])


async def _steps(cfg: Config, built, trainer: Trainer, steps: int, on_step=None) -> tuple[list[float], list[dict]]:
    ctl = Controller(cfg, built.gateway, built.engines, built.pool, trainer, make_suite(cfg.rollout))
    times, rows = [], []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            task = asyncio.ensure_future(ctl.train_step(step))
            if on_step is not None:
                await on_step(step, task)
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
    out = {}
    for backend in ("local", "ray"):
        cfg = _cfg(root, f"steps-{backend}", f"cluster.backend={backend}")
        built, trainer = _build(cfg, root / f"steps-{backend}")
        try:
            times, _ = asyncio.run(_steps(cfg, built, trainer, steps))
        finally:
            built.close()
        out[backend] = statistics.mean(times[1:])
    return out


def _faults(root: Path, steps: int, rng: random.Random) -> dict[str, Any]:
    cfg = _cfg(root, "faults", "cluster.backend=ray", "rollout.infra_retries=3")
    t0 = time.perf_counter()
    built, trainer = _build(cfg, root / "faults")
    startup = time.perf_counter() - t0
    victim = built.engines.engines[rng.randrange(2)]
    killed: list[int] = []

    async def inject(step: int, task: asyncio.Future) -> None:
        if step != 1:
            return
        await asyncio.sleep(rng.uniform(0.05, 0.5))  # a random moment of the step's rollout
        if not task.done():
            killed.append(victim.pid)
            os.kill(victim.pid, signal.SIGKILL)

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
            "steps_finished": len(rows),
            "episodes_lost": sum(e.status.value == "running" for e in episodes),
            "calls_lost": answered - recorded,
            "infra_retries": int(rows[-1].get("rollout/infra_failures", 0)) if rows else 0,
            "rejoined_at_current_version": bool(info["version"] == max(e.version for e in built.engines.engines)
                                                and not victim.down),
        }
    finally:
        built.close()


def _weight_sync(root: Path) -> dict[str, float]:
    cfg = _cfg(root, "ws", "cluster.backend=ray", "model.tiny_hidden=256", "model.tiny_layers=2")
    built, trainer = _build(cfg, root / "ws")
    out = {}
    try:
        state = trainer.engine_state()
        mb = sum(v.numel() * v.element_size() for v in state.values()) / 1e6
        dep = built.cluster
        for method in ("object_store", "safetensors"):
            from arborl.cluster.weights import WEIGHT_SYNC

            dep.publisher.sync = WEIGHT_SYNC.get(method)(root / "ws" / "weights")
            ms = []
            for rep in range(3):
                v = {"object_store": 10, "safetensors": 20}[method] + rep
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
    cfg = _cfg(root, "pd", "cluster.backend=ray", "engine.prefix_cache_tokens=65536", "engine.max_seq_len=4096")
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
    ccfg = _cfg(Path("."), "x").cluster.model_copy(update={"num_cpus": max(2, os.cpu_count() or 2)})
    t0 = time.perf_counter()
    started = start(ccfg)
    init_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="arborl-cluster-bench-") as tmp:
            root = Path(tmp)
            steps = _step_times(root, 3 if quick else 6)
            faults = _faults(root, 3 if quick else 5, rng)
            faults["cluster_startup_s"] = round(faults["cluster_startup_s"] + init_s, 2)
            ws = _weight_sync(root)
            pd = _pd(root, 4 if quick else 8)
    finally:
        stop(started)
    result = {
        "ray_vs_local_step_ratio": round(steps["ray"] / steps["local"], 3),
        "step_s_local": round(steps["local"], 3),
        "step_s_ray": round(steps["ray"], 3),
        **ws, **faults, **pd,
        "ray_init_s": round(init_s, 2),
        "quick": quick,
    }
    table = Table(title="arborl bench cluster (local Ray cluster)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, str(v))
    console.print(table)
    return result
