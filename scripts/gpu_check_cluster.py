"""The Ray deployment on a lent GPU: two CUDA engine actors sharing one GPU (cluster.engine_gpus=0.4
each) and the CUDA trainer in the driver, a few training steps of SmolLM2 (or --model-path), the weight
sync figures for each method (the collective one with the backend it chose: gloo when the engines
share the trainer's GPU, NCCL needs a GPU per rank), an engine actor killed and back at the current version, and PD greedy
outputs equal to colocated ones. One JSON line last; exit status 1 when a check failed.

Run on a CUDA machine that has arborl installed with the ray extra (pip install -e '.[ray]'):

    python scripts/gpu_check_cluster.py [--steps 2] [--model-path DIR] [--tiny]

Budget: about 3-5 minutes (Ray start ~10 s, actors ~20 s, SmolLM2 steps ~10 s each on an H100-class GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from arborl.run.assemble import build_gateway
from arborl.cluster import disaggregate
from arborl.cluster.session import leftover_processes
from arborl.cluster.weights import WEIGHT_SYNC
from arborl.config import load_config
from arborl.run.controller import Controller
from arborl.models import load_model
from arborl.tasks import make_suite
from arborl.train.trainer import Trainer
from arborl.types import GenerateRequest, SamplingParams


def _greedy(prompt, n=24):
    return GenerateRequest(list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2 (fastest)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 1
    model = (["model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_hidden=256", "model.tiny_layers=4",
              "rollout.task=even_tokens"] if a.tiny else
             ["model.source=hf", f"model.path={a.model_path}"] if a.model_path else [])
    out: dict = {"ok": True, "checks": {}}
    root = Path(tempfile.mkdtemp(prefix="arborl-gpu-cluster-"))
    cfg = load_config(None, [*model, f"runs_dir={root}", "name=gpu", "model.device=cuda", "cluster.backend=ray",
                             "cluster.num_cpus=4", "cluster.engine_gpus=0.4", "gateway.num_engines=2",
                             f"rollout.steps={a.steps}", "rollout.eval_tasks=0", "rollout.batch_tasks=4",
                             "scheduling.timeline=false", "engine.max_batch_size=64"])
    built = None

    def check(name: str, ok: bool, detail=None) -> None:
        out["checks"][name] = {"ok": bool(ok), **({"detail": detail} if detail is not None else {})}
        out["ok"] &= bool(ok)

    try:
        loaded = load_model(cfg.model)
        trainer = Trainer(loaded.model, cfg.train, temperature=cfg.rollout.temperature)
        t0 = time.perf_counter()
        built = build_gateway(cfg, loaded=dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).eval()),
                              run_dir=root / "gpu")
        out["cluster_startup_s"] = round(time.perf_counter() - t0, 2)
        engines = built.engines.engines
        infos = [asyncio.run(_info(e)) for e in engines]
        check("engines_on_cuda", all(i["device"].startswith("cuda") for i in infos), [i["device"] for i in infos])

        async def steps():
            ctl = Controller(cfg, built.gateway, built.engines, built.pool, trainer, make_suite(cfg.rollout))
            times = []
            try:
                for s in range(a.steps):
                    t = time.perf_counter()
                    m = await ctl.train_step(s)
                    times.append(time.perf_counter() - t)
            finally:
                await ctl.close()
            return m, times

        m, times = asyncio.run(steps())
        out["step_s"] = [round(t, 2) for t in times]
        check("trained", len({e.version for e in engines}) == 1 and engines[0].version >= 1, [e.version for e in engines])

        state = trainer.engine_state()
        mb = sum(v.numel() * v.element_size() for v in state.values()) / 1e6
        version = engines[0].version
        for method in ("object_store", "safetensors", "collective"):
            sync = WEIGHT_SYNC.get(method)(root / "weights")
            built.cluster.use_sync(sync)
            if method == "collective":  # NCCL needs a GPU per rank; engines sharing the trainer's GPU use gloo
                out["collective_backend"] = sync.backend
            ms = []
            for _ in range(3):
                s = {k: v.clone() for k, v in state.items()}
                t = time.perf_counter()
                version += 1
                asyncio.run(built.engines.update_weights(s, version))
                ms.append((time.perf_counter() - t) * 1000)
            out[f"weight_sync_ms_per_100mb_{method}"] = round(statistics.median(ms) * 100 / mb, 1)

        async def same_tokens():
            return [(await e.generate(_greedy([5, 6, 7]))) for e in engines]

        rs = asyncio.run(same_tokens())  # after the collective's versions: both engines hold the same weights
        check("collective_sync_loaded", rs[0].token_ids == rs[1].token_ids and rs[0].versions[0] == version
              and sync.fallbacks == 0, {"backend": sync.backend, "groups": sync.groups_formed})

        async def pd_vs_colocated():
            pd = disaggregate(engines, 1)[0]
            p = list(range(10, 300))
            return (await pd.generate(_greedy(p))).token_ids, (await engines[1].generate(_greedy(p))).token_ids

        got, want = asyncio.run(pd_vs_colocated())
        check("pd_equals_colocated", got == want)

        victim = engines[0]

        async def kill_and_back():
            os.kill(victim.pid, signal.SIGKILL)
            try:
                await victim.generate(_greedy([1, 2, 3]))
            except Exception:  # noqa: BLE001 - the dead actor's call fails; it comes back
                pass
            deadline = time.monotonic() + 180
            while victim.down and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            return await victim.generate(_greedy([1, 2, 3])), await engines[1].generate(_greedy([1, 2, 3]))

        back, other = asyncio.run(kill_and_back())
        check("killed_engine_back_at_current_version", back.token_ids == other.token_ids
              and back.versions[0] == engines[1].version, {"restarts": victim.restarts})
    except Exception:  # noqa: BLE001
        out["ok"] = False
        out["error"] = traceback.format_exc()[-3000:]
    finally:
        if built is not None:
            built.close()
    time.sleep(3)
    check("no_ray_process_left", leftover_processes() == [], leftover_processes())
    print(json.dumps(out))
    return 0 if out["ok"] else 1


async def _info(engine) -> dict:
    return await engine.actor.info.remote()


if __name__ == "__main__":
    sys.exit(main())
