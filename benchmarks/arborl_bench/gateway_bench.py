"""``arborl bench gateway``: what the gateway costs, and that it loses nothing under load.

The model is a tiny random Llama with SmolLM2's tokenizer and chat template, so the engine is fast
and the gateway's own cost is what is measured. The prefix cache is off, so a gateway call and a
direct call on the same prompt do the same engine work.

1. overhead: multi-turn chat sessions over HTTP on loopback (httpx, keep-alive; the gateway renders
   the template, stitches, records to SQLite, formats the response), each call paired with a
   direct ``AsyncEngine.generate`` of the very prompt the gateway served (same params, greedy,
   fixed length), in alternating order. Added latency = gateway - direct, per pair: p50, p99.
2. load: 64 concurrent sessions (async httpx) run multi-turn conversations for 30 s (quick: 8 s),
   opening new sessions as old ones finish. Every 200 response must be a recorded call:
   ``calls_ok == calls_recorded`` (read back from the data pool), no errors.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from arborl.config import EngineConfig, GatewayConfig, ModelConfig
from arborl.datapool import DataPool
from arborl.engine import AsyncEngine, LLMEngine
from arborl.engine.pool import EnginePool
from arborl.gateway import Gateway
from arborl.gateway.server import GatewayServer
from arborl.models import load_model
from arborl.types import GenerateRequest, SamplingParams

ADMIN = "bench-admin"
SYSTEM = "You are a terse assistant. Answer in a few words."
NEW_TOKENS = 8


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _session(http: httpx.Client, base: str) -> dict[str, str]:
    r = http.post(base + "/sessions", json={"task_id": "bench"}, headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    return r.json()


def _overhead(srv: GatewayServer, engine: AsyncEngine, model: str, pairs: int, turns: int) -> dict[str, float]:
    base = srv.base_url
    loop = asyncio.new_event_loop()
    gw_ms, direct_ms, diffs = [], [], []
    params = {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(timeout=60) as http:
        done, conv = 0, 0
        while done < pairs:
            s = _session(http, base)
            headers = {"Authorization": f"Bearer {s['api_key']}"}
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question number {conv}?"}]
            conv += 1
            for turn in range(turns):
                t0 = time.perf_counter()
                r = http.post(base + "/chat/completions", json={"model": model, "messages": msgs, **params}, headers=headers)
                t_gw = time.perf_counter() - t0
                r.raise_for_status()
                body = r.json()
                req = GenerateRequest(body["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
                t0 = time.perf_counter()
                loop.run_until_complete(engine.generate(req))
                t_direct = time.perf_counter() - t0
                if done % 2:  # every other pair, time the gateway *after* the direct call (order bias);
                    # the same messages again get the same prompt tokens (a resample of the call)
                    t0 = time.perf_counter()
                    r = http.post(base + "/chat/completions", json={"model": model, "messages": msgs, **params}, headers=headers)
                    t_gw = time.perf_counter() - t0
                    r.raise_for_status()
                    body = r.json()
                gw_ms.append(t_gw * 1e3)
                direct_ms.append(t_direct * 1e3)
                diffs.append((t_gw - t_direct) * 1e3)
                done += 1
                msgs = msgs + [body["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
                if done >= pairs:
                    break
            http.post(base + f"/sessions/{s['session_id']}/finish", json={}, headers=headers)
    loop.close()
    return {
        "overhead_p50_ms": statistics.median(diffs),
        "overhead_p90_ms": _pct(diffs, 0.90),
        "overhead_p99_ms": _pct(diffs, 0.99),
        "gateway_p50_ms": statistics.median(gw_ms),
        "direct_p50_ms": statistics.median(direct_ms),
        "pairs": len(diffs),
    }


async def _load(base: str, model: str, sessions: int, seconds: float, turns: int) -> dict:
    ok = 0
    errors: dict[str, int] = {}
    latencies: list[float] = []
    session_ids: list[str] = []
    completion_tokens = 0
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=sessions * 2, max_keepalive_connections=sessions * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def worker(w: int) -> None:
            nonlocal ok, completion_tokens
            conv = 0
            while time.monotonic() < end:
                r = await http.post(base + "/sessions", json={"task_id": "load"}, headers={"Authorization": f"Bearer {ADMIN}"})
                s = r.json()
                session_ids.append(s["session_id"])
                headers = {"Authorization": f"Bearer {s['api_key']}"}
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Worker {w}, conversation {conv}?"}]
                conv += 1
                for turn in range(turns):
                    t0 = time.perf_counter()
                    r = await http.post(base + "/chat/completions", headers=headers,
                                        json={"model": model, "messages": msgs, "max_tokens": NEW_TOKENS, "temperature": 1.0})
                    latencies.append((time.perf_counter() - t0) * 1e3)
                    if r.status_code != 200:
                        errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                        break
                    ok += 1
                    body = r.json()
                    completion_tokens += body["usage"]["completion_tokens"]
                    msgs = msgs + [body["choices"][0]["message"], {"role": "user", "content": f"Go on ({turn})."}]
                    if time.monotonic() >= end:
                        break
                await http.post(base + f"/sessions/{s['session_id']}/finish", json={}, headers=headers)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(sessions)))
        wall = time.perf_counter() - t0
    return {"calls_ok": ok, "errors": errors, "latencies": latencies, "session_ids": session_ids,
            "wall_s": wall, "completion_tokens": completion_tokens}


def run(quick: bool, console: Console) -> dict:
    torch.manual_seed(0)
    console.print("loading a tiny random Llama with SmolLM2's tokenizer ...")
    loaded = load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2"))
    ecfg = EngineConfig(max_batch_size=64, max_seq_len=1024, prefix_cache=False, num_threads=1)
    engine = AsyncEngine(LLMEngine(loaded.model, ecfg, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer))
    sessions, seconds = 64, (8.0 if quick else 30.0)
    pairs = 120 if quick else 400
    with tempfile.TemporaryDirectory(prefix="arborl-bench-gw-") as tmp:
        pool = DataPool(Path(tmp) / "datapool.sqlite")
        gw = Gateway(EnginePool([engine]), datapool=pool, tokenizer=loaded.tokenizer, model_name="bench-tiny",
                     config=GatewayConfig(), admin_key=ADMIN)
        try:
            with GatewayServer(gw) as srv:
                console.print("warming up ...")
                _overhead(srv, engine, gw.model_name, 20, 4)
                console.print(f"overhead: {pairs} paired calls (gateway over HTTP vs direct engine) ...")
                ov = _overhead(srv, engine, gw.model_name, pairs, 4)
                console.print(f"load: {sessions} concurrent sessions for {seconds:.0f} s ...")
                ld = asyncio.run(_load(srv.base_url, gw.model_name, sessions, seconds, 6))
            recorded = sum(len(pool.calls(sid)) for sid in ld["session_ids"])
        finally:
            engine.shutdown()
            pool.close()
    lat = ld["latencies"]
    figures = {
        "bench": "gateway",
        "quick": quick,
        "overhead_p50_ms": round(ov["overhead_p50_ms"], 3),
        "overhead_p90_ms": round(ov["overhead_p90_ms"], 3),
        "overhead_p99_ms": round(ov["overhead_p99_ms"], 3),
        "gateway_call_p50_ms": round(ov["gateway_p50_ms"], 3),
        "direct_call_p50_ms": round(ov["direct_p50_ms"], 3),
        "overhead_pairs": ov["pairs"],
        "concurrent_sessions": sessions,
        "load_seconds": round(ld["wall_s"], 2),
        "sessions_opened": len(ld["session_ids"]),
        "calls_ok": ld["calls_ok"],
        "calls_recorded": recorded,
        "calls_lost": ld["calls_ok"] - recorded,
        "errors": sum(ld["errors"].values()),
        "calls_per_s": round(ld["calls_ok"] / ld["wall_s"], 2),
        "completion_tokens_per_s": round(ld["completion_tokens"] / ld["wall_s"], 1),
        "load_latency_p50_ms": round(statistics.median(lat), 2) if lat else None,
        "load_latency_p99_ms": round(_pct(lat, 0.99), 2) if lat else None,
    }
    table = Table(title="arborl bench gateway (tiny Llama, SmolLM2 tokenizer, CPU, loopback)")
    table.add_column("figure")
    table.add_column("value")
    for k, v in figures.items():
        if k not in ("bench", "quick"):
            table.add_row(k, str(v))
    console.print(table)
    return figures
