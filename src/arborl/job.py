"""The training job ``arborl train`` runs, and the evaluation ``arborl eval`` runs.

runs/<name>/ gets config.yaml, metrics.jsonl (one line per step and per evaluation),
datapool.sqlite (every call of every episode), checkpoint/ (model, optimiser, step, RNG),
summary.json and curves.png.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from arborl.assemble import build_gateway
from arborl.config import Config, dump_config
from arborl.controller import Controller
from arborl.extensions import check_extensions
from arborl.models import load_model
from arborl.report import MetricsLog, plot_curves, summary_table
from arborl.tasks import make_suite
from arborl.train.checkpoint import CheckpointError, load_checkpoint, load_model_weights, save_checkpoint
from arborl.train.trainer import Trainer
from arborl.types import ArborlError


def _controller(cfg: Config, trainer: Trainer | None, serving_model, loaded, run_dir: Path, version: int = 0,
                start_step: int = 0):
    """Gateway + engines serving ``serving_model`` (never the trainer's own module) as policy
    ``version``, and the controller around them."""
    built = build_gateway(
        cfg, loaded=dataclasses.replace(loaded, model=serving_model.eval()), run_dir=run_dir, version=version
    )
    ctl = Controller(cfg, built.gateway, built.engines, built.pool, trainer, make_suite(cfg.rollout),
                     version=version, start_step=start_step)
    return built, ctl


def train(cfg: Config, *, resume: bool = False, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    check_extensions(cfg)
    torch.manual_seed(cfg.seed)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "checkpoint"
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    if not resume and (metrics.read() or ckpt.exists()):
        raise ArborlError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another name")
    (run_dir / "config.yaml").write_text(dump_config(cfg))

    console.print(f"[bold]arborl train[/bold] {cfg.name}: {cfg.rollout.task} on {cfg.model.source}, "
                  f"{cfg.rollout.steps} steps x {cfg.rollout.batch_tasks} tasks x {cfg.rollout.group_size} episodes")
    t_start = time.perf_counter()
    loaded = load_model(cfg.model)
    serving = copy.deepcopy(loaded.model)  # the engines' copy: plain names even when training LoRA
    trainer = Trainer(loaded.model, cfg.train, temperature=cfg.rollout.temperature)
    start_step, version, summary_prev = 0, 0, {}
    if resume:
        if not ckpt.exists() and not list(run_dir.glob(".checkpoint.old-*")):
            raise CheckpointError(f"--resume: {ckpt} does not exist")
        extra = load_checkpoint(ckpt, trainer)
        start_step, summary_prev = extra["step"], extra.get("summary", {})
        version = extra.get("version", start_step)
        metrics.truncate_after(start_step)
        serving.load_state_dict(trainer.engine_state())
        console.print(f"resumed from {ckpt} at step {start_step}")

    launched, ctl = _controller(cfg, trainer, serving, loaded, run_dir, version, start_step)
    try:
        summary = asyncio.run(_train_loop(cfg, ctl, trainer, metrics, start_step, summary_prev, ckpt, console))
    finally:
        launched.close()
    summary["wall_s"] = round(time.perf_counter() - t_start + summary_prev.get("wall_s", 0.0), 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    records = metrics.read()
    plot_curves([r for r in records if r.get("kind") == "step"], ["reward", "success", "tool_use"],
                run_dir / "curves.png", title=f"{cfg.name}: reward and success per step")
    console.print(summary_table(summary, title=f"arborl train {cfg.name}"))
    console.print(f"outputs in {run_dir}/")
    return summary


async def _train_loop(cfg, ctl: Controller, trainer: Trainer, metrics: MetricsLog, start_step: int,
                      summary_prev: dict, ckpt: Path, console: Console) -> dict[str, Any]:
    r = cfg.rollout
    summary: dict[str, Any] = dict(summary_prev)
    if start_step == 0 and r.eval_tasks:
        console.print(f"evaluating the starting policy on {r.eval_tasks} held-out tasks ...")
        ev = await ctl.evaluate(r.eval_tasks)
        metrics.write({"kind": "eval", "step": 0, **ev})
        summary["eval_success_before"] = ev["eval_success"]
        console.print(f"  held-out success before RL: {ev['eval_success']:.3f}")
    columns = [TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("train", total=r.steps, completed=start_step, info="")
        for step in range(start_step, r.steps):
            m = await ctl.train_step(step)
            metrics.write({"kind": "step", **m})
            progress.update(bar, advance=1, info=(
                f"reward {m['reward']:.2f}  success {m['success']:.2f}  {m['rollout_tokens_per_s']:.0f} tok/s  "
                f"step {m['step_s']:.0f}s"))
            last = step + 1 == r.steps
            if r.eval_every and (step + 1) % r.eval_every == 0 and not last:
                ev = await ctl.evaluate(r.eval_tasks)
                metrics.write({"kind": "eval", "step": step + 1, **ev})
            if last or (r.checkpoint_every and (step + 1) % r.checkpoint_every == 0):
                summary["steps"] = step + 1
                await asyncio.to_thread(save_checkpoint, ckpt, trainer, {"step": step + 1, "version": ctl.version, "summary": summary})
    steps = [x for x in metrics.read() if x.get("kind") == "step"]
    summary["steps"] = r.steps
    if steps:
        summary["reward_first_step"] = steps[0]["reward"]
        summary["reward_last_step"] = steps[-1]["reward"]
        summary["mean_step_s"] = round(sum(x["step_s"] for x in steps) / len(steps), 2)
    if r.eval_tasks:
        console.print(f"evaluating the trained policy on {r.eval_tasks} held-out tasks ...")
        ev = await ctl.evaluate(r.eval_tasks)
        metrics.write({"kind": "eval", "step": r.steps, **ev})
        summary["eval_success_after"] = ev["eval_success"]
        if "eval_success_before" in summary:
            summary["eval_success_gain"] = round(ev["eval_success"] - summary["eval_success_before"], 4)
    return summary


def evaluate(cfg: Config, checkpoint: str | Path | None, *, console: Console | None = None) -> dict[str, Any]:
    """Held-out success of the configured model, or of a checkpoint's weights."""
    console = console or Console()
    check_extensions(cfg)
    loaded = load_model(cfg.model)
    model = loaded.model
    if checkpoint is not None:
        if cfg.train.lora_rank > 0:  # the checkpoint holds the peft-wrapped model: rebuild it, merge
            trainer = Trainer(load_model(cfg.model).model, cfg.train)
            load_model_weights(checkpoint, trainer.model)
            model.load_state_dict(trainer.engine_state())
        else:
            load_model_weights(checkpoint, model)
    run_dir = cfg.run_dir / "eval"
    launched, ctl = _controller(cfg, None, model, loaded, run_dir)
    try:
        ev = asyncio.run(ctl.evaluate(cfg.rollout.eval_tasks))
    finally:
        launched.close()
    ev = {"checkpoint": str(checkpoint) if checkpoint else None, **ev}
    console.print(summary_table(ev, title="arborl eval"))
    return ev
