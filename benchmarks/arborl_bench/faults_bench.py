"""``arborl bench faults``: nothing lost, at scale (issue 49), as counts.

1. kills: the tiny asynchronous job (random 1-layer Llama, SmolLM2's tokenizer, chain_tokens,
   ``scheduling.consume=async_ratio``, a checkpoint every step) SIGKILLed ``kills`` times and resumed
   each time: half the kills at a named moment drawn at random (``ARBORL_FAILPOINTS``: before a step
   trains, before the weight update, after a step, mid-save), half from outside at a random second of
   the run. The data pool's ledger (``datapool/ledger.exactly_once``) then counts prompts skipped and
   trained twice, episodes trained twice and committed episodes dropped, and the decoded tokens of the
   episodes in flight at the kills (aborted, run again). An uninterrupted run of the same config is
   the reference (``reference_prompts_trained``).
2. fuzz: ``fuzz_bodies`` OpenAI-shaped bodies (``openai_fuzz.py``) at a live gateway on the tiny model
   with SmolLM2's tokenizer; ``fuzz_5xx`` must be 0. Then 8 concurrent requests, one of them poisoned
   (a prompt holding a token whose embedding row is NaN): ``poison_failed_alone`` and
   ``poison_others_finished`` (7).
3. sandboxes: the envs bench's concurrency sweep (16, 64, 256 sandboxes at once):
   ``sandbox_start_failures_256``, ``sandbox_leftovers``, start p50/p99.
4. node loss: ``node_loss.run_node_loss`` (a Ray cluster of several raylets on this host, one killed).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from arborl.datapool import DataPool
from arborl.datapool.ledger import exactly_once
from arborl.failpoints import ENV as FAILPOINTS
from arborl_bench.figures import figure_table

POINTS = ("train", "publish", "step_end", "save")
TINY = ["seed=3", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=512", "engine.max_batch_size=16", "rollout.task=chain_tokens", "rollout.batch_tasks=4",
        "rollout.group_size=4", "rollout.max_tokens=8", "rollout.eval_tasks=0", "train.lr=0.1",
        "scheduling.timeline=false", "rollout.checkpoint_every=1", "scheduling.consume=async_ratio",
        "scheduling.async_ratio=1", "report.curves=false", "rollout.max_idle_steps=0"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _arborl(*args: str) -> list[str]:
    return [sys.executable, "-m", "arborl.cli", *args]


def _sets(items: list[str]) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def _attempt(cmd: list[str], rng: random.Random, how: str, timeout_s: float) -> int:
    """One process of the run: killed at a random named moment, from outside at a random second, or not."""
    env = dict(ENV)
    if how == "failpoint":
        env[FAILPOINTS] = f"{rng.choice(POINTS)}@{rng.randint(1, 3)}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        if how == "outside":
            try:
                return proc.wait(timeout=rng.uniform(4.0, 12.0))  # the model loads in ~4 s: most land mid-run
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def section_kills(quick: bool, console: Console, work: Path) -> dict[str, Any]:
    kills, steps = (4, 8) if quick else (10, 30)
    rng = random.Random(49)
    ref = work / "ref"
    code = _attempt(_arborl("train", *_sets([f"runs_dir={work}", "name=ref", f"rollout.steps={steps}", *TINY])), rng, "none", 900)
    if code != 0:
        raise RuntimeError(f"the uninterrupted reference run failed (exit {code})")
    run = work / "k"
    first = _arborl("train", *_sets([f"runs_dir={work}", "name=k", f"rollout.steps={steps}", *TINY]))
    resume = _arborl("train", "--resume", str(run))
    killed, attempts, finished, t0 = 0, 0, False, time.perf_counter()
    while killed < kills:
        started = (run / "config.yaml").exists()  # a kill before the run wrote anything: start it again
        code = _attempt(resume if started else first, rng, "failpoint" if killed % 2 else "outside", 900)
        attempts += 1
        if code == 0:
            finished = True  # the run ended before this kill landed
            break
        if code != -signal.SIGKILL:
            raise RuntimeError(f"attempt {attempts} exited {code}")
        killed += 1
    if not finished and _attempt(resume if (run / "config.yaml").exists() else first, rng, "none", 900) != 0:
        raise RuntimeError("the last resume failed")
    with DataPool(run / "datapool.sqlite") as pool, DataPool(ref / "datapool.sqlite") as ref_pool:
        counts, reference = exactly_once(pool), exactly_once(ref_pool)
    console.print(f"kills: {killed} SIGKILLs, {time.perf_counter() - t0:.0f} s; {json.dumps(counts)}")
    return {**counts, "kills": killed, "reference_prompts_trained": reference["prompts_trained"],
            "reference_episodes_trained": reference["episodes_trained"],
            "steps": steps, "leftover_checkpoint_temps": len(list(run.glob(".checkpoint.*")))}


def section_fuzz(quick: bool, console: Console, work: Path) -> dict[str, Any]:
    import torch

    from arborl.config import load_config
    from arborl.gateway.server import GatewayServer
    from arborl.models import load_model
    from arborl.run.assemble import build_gateway
    from arborl_bench.openai_fuzz import fuzz_requests, server_errors

    cfg = load_config(None, [f"runs_dir={work}", "name=fuzz", *TINY, "gateway.admin_key=adm"])
    loaded = load_model(cfg.model)
    poison = 4242
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[poison] = float("nan")
    built = build_gateway(cfg, loaded=loaded, run_dir=work / "fuzz")
    server = GatewayServer(built.gateway).start()
    n = 200 if quick else 558
    statuses: dict[int, int] = {}
    try:
        with httpx.Client(timeout=120) as http:
            def session() -> dict[str, str]:
                r = http.post(server.base_url + "/sessions", json={}, headers={"Authorization": "Bearer adm"})
                return {"Authorization": f"Bearer {r.json()['api_key']}"}

            auth, errors = session(), 0
            for i, req in enumerate(fuzz_requests(558, n, vocab_size=loaded.vocab_size)):
                if i % 25 == 0:
                    auth = session()
                r = http.post(server.base_url + req.path, content=req.body, headers={**auth, "content-type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                errors += server_errors(r.status_code, r.text)

            async def eight() -> list[int]:
                async with httpx.AsyncClient(timeout=120) as ah:
                    auths = [session() for _ in range(8)]
                    bodies = [{"prompt": [10 + i, 20, 30] + ([poison] if i == 3 else []) + [40], "max_tokens": 16,
                               "temperature": 0, "ignore_eos": True} for i in range(8)]
                    rs = await asyncio.gather(*(ah.post(server.base_url + "/completions", json=b, headers=a)
                                                for b, a in zip(bodies, auths)))
                    return [r.status_code for r in rs]

            poisoned = asyncio.run(eight())
    finally:
        server.stop()
        built.close()
    others = sum(s == 200 for i, s in enumerate(poisoned) if i != 3)
    console.print(f"fuzz: {n} bodies, statuses {statuses}; poisoned request among 8: {poisoned}")
    return {"fuzz_bodies": n, "fuzz_5xx": errors, "fuzz_statuses": {str(k): v for k, v in sorted(statuses.items())},
            "poison_failed_alone": poisoned[3] >= 500 and others == 7, "poison_others_finished": others}


def section_sandboxes(quick: bool, console: Console) -> dict[str, Any]:
    from arborl_bench.envs_bench import section_sweep

    return section_sweep(quick, console)


def section_node_loss(quick: bool, console: Console) -> dict[str, Any]:
    try:
        from arborl_bench.node_loss import run_node_loss
    except ModuleNotFoundError as e:
        return {"node_loss_episodes_lost": None, "node_loss_run_finished": None, "node_loss_error": str(e)}
    return run_node_loss(quick, console)


def run(quick: bool, console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="arborl-bench-faults-") as d:
        work = Path(d)
        out.update(section_kills(quick, console, work))
        out.update(section_fuzz(quick, console, work))
    out.update(section_sandboxes(quick, console))
    out.update(section_node_loss(quick, console))
    console.print(figure_table("arborl bench faults", out, (
        "kills", "prompts_skipped", "prompts_duplicated", "episodes_trained_twice", "episodes_dropped",
        "decoded_tokens_discarded", "replayed_tokens", "fuzz_5xx", "poison_others_finished", "sandbox_start_failures_256",
        "sandbox_start_p99_ms_256", "sandbox_leftovers", "node_loss_episodes_lost", "node_loss_run_finished")))
    return out
