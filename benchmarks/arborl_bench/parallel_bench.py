"""``arborl bench parallel``: one process vs 2 FSDP2 ranks (gloo, 1 thread each) on SmolLM2-135M.

Same batch, same start weights, 3 optimiser steps each:

* ``loss_max_rel_diff``, ``grad_max_rel_diff`` (per tensor: max |g2 - g1| / max |g1|, the worst tensor and
  step), ``param_max_rel_diff`` after the 3 steps: against one process that accumulates the ranks' own
  micro-batches (each rank's share, in rank order), so only the distribution differs;
  ``*_one_microbatch`` (``grad_rel_diff_by_step`` each step's): against one process with the whole batch
  in one micro-batch, read against ``grad_floor_rel_diff``, the same measure between two single-process
  first steps whose micro-batches differ (256 vs 4096 tokens): float32's summation-order floor;
* ``memory_per_rank_ratio``: bytes of parameters + gradients + optimiser state an FSDP2 rank holds
  (its local shards, counted from the tensors) / the one process's;
* ``step_time_ratio``: median step time of the 2 ranks (1 thread each) / the one process (2 threads),
  steps after the first;
* ``sync_stream_s`` / ``sync_gather_s``: the whole policy out of the shards to this process, one layer
  at a time / gathered at once on rank 0, and ``sync_stream_peak_ratio``: the largest chunk rank 0
  held / the model's bytes;
* ``episodes_lost``, ``rank_killed``, ``run_finished_after_rank_kill``, ``rank_processes_left``: the tiny
  ``arborl train`` job on 2 FSDP2 ranks (Ray actors) under a Ray trainer actor (cluster.trainer_restarts=1), one rank
  SIGKILLed at a random moment after the first checkpoint; the run must finish from it, with every
  episode committed before the kill still in the data pool and no rank process left.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from arborl.config import ModelConfig, TrainConfig
from arborl.train.parallel import balanced_split
from arborl.train.trainer import StepPlan, Trainer
from arborl.types import Sample

STEPS = 3


def smollm2() -> torch.nn.Module:
    """SmolLM2-135M-Instruct in float32 (module-level: each rank builds it itself)."""
    from arborl.models import load_model

    return load_model(ModelConfig(source="smollm2")).model.float()


def workload(vocab: int, groups: int, size: int, prompt: int, response: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        head = [rng.randrange(vocab) for _ in range(prompt)]
        for k in range(size):
            n = rng.randint(response // 2, response)
            toks = head + [rng.randrange(vocab) for _ in range(n)]
            mask = [0] * prompt + [1] * n
            adv = rng.gauss(0, 1)
            out.append(Sample(
                episode_id=f"e{g}-{k}", group_id=f"g{g}", token_ids=toks, loss_mask=mask,
                rollout_logprobs=[-rng.uniform(1, 4) if m else 0.0 for m in mask], versions=[0] * len(toks),
                chunk_ids=[0] * len(toks), advantages=[adv if m else 0.0 for m in mask], reward=adv,
            ))
    return out


class SharesTrainer(Trainer):
    """One process whose micro-batches are the ranks' shares (each rank's balanced share of a step, in
    rank order): it sums the same micro-batch gradients in the ranks' order, so what is left between it
    and the ranks is the distribution itself (split, normalisation, the sum)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, ranks: int) -> None:
        self.ranks = ranks
        super().__init__(model, cfg)

    def _plan(self, samples: list[Sample], part: list[int]) -> StepPlan:
        sub = [samples[i] for i in part]
        micro = []
        for share in balanced_split(sub, self.ranks, tree=self.cfg.packing != "flat"):
            micro += self._packed(samples, [part[i] for i in share])
        return StepPlan(micro, len(micro))


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor of ``a`` from ``b``'s, relative to ``b``'s largest entry."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


def _rank_processes() -> set[int]:
    """Every trainer rank process on this machine: ``arborl.train.ranks`` children and Ray rank actors."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (b"arborl.train.ranks" in cmd or b"ray::RankActor" in cmd) and state != "Z":
            out.add(int(entry))
    return out


def killed_rank(rng: random.Random) -> dict:
    """The tiny job on 2 FSDP2 ranks (Ray actors) beside a Ray trainer actor, a rank SIGKILLed after the
    first checkpoint. 2 CPUs: the engine 1, the trainer actor 0.5, each rank 0.25."""
    from arborl_bench.cluster_bench import killed_run, tiny_job

    before = _rank_processes()
    with tempfile.TemporaryDirectory(prefix="arborl-parallel-bench-") as tmp:
        cfg = tiny_job(Path(tmp), "killed-rank", "cluster.backend=ray", "cluster.trainer_restarts=1",
                       "cluster.trainer_cpus=0.5", "gateway.num_engines=1", "cluster.engine_cpus=1", "cluster.rank_cpus=0.25",
                       "rollout.steps=3", "rollout.checkpoint_every=1", "train.parallel.ranks=2",
                       "train.parallel.strategy=fsdp2", "train.packing=tree")

        def victim() -> int | None:
            ranks = sorted(_rank_processes() - before)
            return rng.choice(ranks) if ranks else None

        out = killed_run(cfg, rng, victim)
    left = _rank_processes() - before
    return {"rank_killed": out["killed"], "run_finished_after_rank_kill": out["finished"],
            "episodes_lost": out["episodes_lost"], "rank_processes_left": len(left),
            **({"rank_kill_error": out["error"]} if "error" in out else {})}


def run(quick: bool, console: Console) -> dict:
    from arborl.train.parallel import full_grads, full_params, single_state_bytes
    from arborl.train.ranks import RankGroup

    groups, size, prompt, response = (4, 4, 48, 24) if quick else (8, 4, 96, 48)
    base = dict(lr=1e-5, packing="tree", micro_batch_tokens=4096, grad_clip=1.0)
    model = smollm2()
    samples = workload(model.config.vocab_size, groups, size, prompt, response)
    console.print(f"[bold]parallel[/bold]: SmolLM2-135M float32, {len(samples)} samples in {groups} groups, "
                  f"{STEPS} steps; 1 process x 2 threads vs 2 FSDP2 ranks x 1 thread (gloo)")

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        single = Trainer(model, TrainConfig(**base))
        ref_metrics, ref_grads = [], []
        for _ in range(STEPS):
            ref_metrics.append(single.train_step(samples))
            ref_grads.append(full_grads(single))
            console.print(f"  1 process  step {len(ref_metrics)}: {ref_metrics[-1]['train/step_s']:.2f} s")
        ref_params = full_params(single)
        ref_bytes = single_state_bytes(single)["total"]
        del single
        # the float32 floor: the same process and first step with the batch cut into other micro-batches
        # (another summation order of the same gradient), against which the ranks' difference is read
        other = Trainer(smollm2(), TrainConfig(**{**base, "micro_batch_tokens": 256}))
        other.train_step(samples)
        floor = rel_diff(full_grads(other), ref_grads[0])
        del other
        # the same process over the ranks' own micro-batches (each rank's share, rank order)
        shares = SharesTrainer(smollm2(), TrainConfig(**base), 2)
        share_metrics, share_grads = [], []
        for _ in range(STEPS):
            share_metrics.append(shares.train_step(samples))
            share_grads.append(full_grads(shares))
        share_params = full_params(shares)
        del shares
    finally:
        torch.set_num_threads(threads)
    del model

    cfg = TrainConfig(**base, parallel={"ranks": 2, "strategy": "fsdp2", "threads_per_rank": 1})
    metrics, by_step, by_step_shares = [], [], []
    with RankGroup(smollm2, cfg) as group:
        for step in range(STEPS):
            metrics.append(group.train_step(samples))
            grads = group.run(full_grads)[0]
            by_step.append(rel_diff(grads, ref_grads[step]))
            by_step_shares.append(rel_diff(grads, share_grads[step]))
            del grads
            console.print(f"  2 ranks    step {step + 1}: {metrics[-1]['train/step_s']:.2f} s")
        rank_params = group.run(full_params)[0]
        param_diff, param_diff_shares = rel_diff(rank_params, ref_params), rel_diff(rank_params, share_params)
        del rank_params
        rank_bytes = [b["total"] for b in group.state_bytes()]
        t0 = time.perf_counter()
        state: dict[str, torch.Tensor] = {}
        peak = group.stream_state(state.update)
        stream_s = time.perf_counter() - t0
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        del state
        t0 = time.perf_counter()
        gathered = group.gather_state()
        gather_s = time.perf_counter() - t0
        del gathered

    def loss_diff_to(refs: list[dict]) -> float:
        return max(abs(m["loss/total"] - r["loss/total"]) / max(abs(r["loss/total"]), 1e-12) for m, r in zip(metrics, refs))

    one = statistics.median(m["train/step_s"] for m in ref_metrics[1:])
    two = statistics.median(m["train/step_s"] for m in metrics[1:])
    out = {
        "benchmark": "parallel", "quick": quick, "model": "SmolLM2-135M-Instruct", "ranks": 2, "strategy": "fsdp2",
        "steps": STEPS, "samples": len(samples),
        # against the one process over the ranks' own micro-batches: the distribution's error alone
        "loss_max_rel_diff": loss_diff_to(share_metrics),
        "grad_max_rel_diff": max(by_step_shares),
        "param_max_rel_diff": param_diff_shares,
        # against the one process with the whole batch as one micro-batch: float32's summation order too
        # (step 1 starts from the same weights; later steps also carry the parameters' own drift), read
        # against grad_floor_rel_diff, one process against itself with other micro-batches
        "loss_max_rel_diff_one_microbatch": loss_diff_to(ref_metrics),
        "grad_max_rel_diff_one_microbatch": max(by_step),
        "grad_rel_diff_by_step": by_step,
        "grad_floor_rel_diff": floor,
        "param_max_rel_diff_one_microbatch": param_diff,
        "grad_norm_rel_diff": max(abs(m["train/grad_norm"] - r["train/grad_norm"]) / r["train/grad_norm"]
                                  for m, r in zip(metrics, ref_metrics)),
        "memory_single_mb": round(ref_bytes / 2**20, 1),
        "memory_per_rank_mb": [round(b / 2**20, 1) for b in rank_bytes],
        "memory_per_rank_ratio": round(max(rank_bytes) / ref_bytes, 4),
        "step_s_single": round(one, 3),
        "step_s_ranks": round(two, 3),
        "step_time_ratio": round(two / one, 3),
        "sync_stream_s": round(stream_s, 3),
        "sync_gather_s": round(gather_s, 3),
        "sync_stream_peak_ratio": round(peak / model_bytes, 4),
    }
    console.print("  a rank killed in a run (tiny job, 2 FSDP2 rank actors, a Ray trainer actor) ...")
    out.update(killed_rank(random.Random(0)))
    table = Table(title="1 process vs 2 FSDP2 ranks (SmolLM2-135M, gloo, CPU)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in ("loss_max_rel_diff", "grad_max_rel_diff", "param_max_rel_diff", "grad_max_rel_diff_one_microbatch",
                "grad_floor_rel_diff", "param_max_rel_diff_one_microbatch", "memory_per_rank_ratio",
                "step_time_ratio", "sync_stream_s", "sync_gather_s", "sync_stream_peak_ratio", "rank_killed",
                "run_finished_after_rank_kill", "episodes_lost", "rank_processes_left"):
        value = out[key]
        table.add_row(key, f"{value:.3g}" if isinstance(value, float) else str(value))
    console.print(table)
    return out
