"""Supervised fine-tuning: `arborl sft`, the warm-start stage of `arborl train` (train.sft), and
rejection-sampling fine-tuning / expert iteration (train.sft.rejection).

Inputs are transcripts, OpenAI-style ``{"messages": [...], "tools": [...]}`` rows in JSONL or Parquet
files (what `arborl envs demos` writes), or episodes the rollout recorded in the data pool. A
transcript is rendered by the gateway's own renderer (``gateway/transcript.py``: the served chat
template, tool prompt and tool-call format) into one sample with loss on the assistant's tokens; a
recorded episode is trained on its exact recorded tokens (``train/samples.py``). The steps are the
policy trainer's (``train/sft.py``): the same model, LoRA or full, micro-batches and tree packing.

`arborl sft CONFIG` writes a run directory like `arborl train`: config.yaml, metrics.jsonl (one
``step`` row per optimiser step, ``eval`` rows with the held-out NLL), checkpoint/ (a Hugging Face
model directory), summary.json and curves.png.

Rejection sampling (``rejection_round``): k episodes per train-split task from the current policy
through the gateway (recorded, scored, judged like RL episodes), or from any OpenAI-compatible
endpoint (``base_url``: transcripts re-rendered by the policy's template); exactly the episodes whose
outcome is 1 are kept and fine-tuned on.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from arborl.agents.recording import EndpointClient
from arborl.config import Config, ConfigError, dump_config
from arborl.gateway.errors import BadRequestError
from arborl.gateway.render import ChatRenderer
from arborl.gateway.transcript import transcript_sample
from arborl.heap import set_mmap_threshold
from arborl.models import load_model
from arborl.report import plot_run, summary_table
from arborl.report.loggers import RunLoggers, check_loggers
from arborl.run_config import CONFIG_FILE
from arborl.run.rundir import RunDir
from arborl.train.checkpoint import save_checkpoint
from arborl.train.samples import episode_samples, usable
from arborl.train.sft import masked_nll, sft_config, sft_epochs, sft_mode
from arborl.train.trainer import Trainer
from arborl.types import ArborlError, Episode, EpisodeStatus, Sample, Task


class TranscriptError(ArborlError, ValueError):
    """A transcript file or row is unusable; the message names the file, the row and what to fix."""


# -- transcripts -> samples -------------------------------------------------------------------------
def read_transcripts(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Rows of JSONL / Parquet files, each {"messages": [...], "tools": [...] (optional)}, plus "_where"."""
    rows: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise TranscriptError(f"transcript file {p} does not exist (train.sft.files / --data)")
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq

            got = [(f"{p} row {i + 1}", r) for i, r in enumerate(pq.read_table(p).to_pylist())]
        else:
            got = []
            for i, line in enumerate(p.read_text().splitlines()):
                if not line.strip():
                    continue
                try:
                    got.append((f"{p}:{i + 1}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise TranscriptError(f"{p}:{i + 1}: not a JSON object ({e.msg}); write one transcript per line") from e
        for where, r in got:
            if not isinstance(r, dict) or not isinstance(r.get("messages"), list):
                raise TranscriptError(f"{where}: a transcript needs a 'messages' list (OpenAI chat messages)")
            if isinstance(r.get("messages"), str):
                r["messages"] = json.loads(r["messages"])
            rows.append({**r, "_where": where})
    if not rows:
        raise TranscriptError(f"no transcripts in {', '.join(map(str, paths)) or '(no files)'}")
    return rows


def transcript_samples(renderer: ChatRenderer, rows: Sequence[dict[str, Any]]) -> list[Sample]:
    out = []
    for r in rows:
        try:
            out.append(transcript_sample(renderer, r["messages"], r.get("tools") or None))
        except BadRequestError as e:
            raise TranscriptError(f"{r.get('_where', 'transcript')}: {e}") from e
    return out


def episode_sft_samples(episodes: Sequence[Episode]) -> list[Sample]:
    """Recorded episodes -> samples of their exact tokens, loss on the generated ones (advantage 1)."""
    out = []
    for e in episodes:
        for s in episode_samples(e.calls):
            s.advantages = [1.0] * len(s.token_ids)
            s.group_id = s.group_id or e.group_id
            out.append(s)
    return out


def split_heldout(samples: list[Sample], fraction: float, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out): whole prompt groups go to one side, so no held-out transcript shares a task prompt
    with a trained one; at least one group stays in training."""
    groups = sorted({s.group_id for s in samples})
    random.Random(seed).shuffle(groups)
    n = min(len(groups) - 1, round(fraction * len(groups))) if fraction > 0 else 0
    held = set(groups[:n])
    return [s for s in samples if s.group_id not in held], [s for s in samples if s.group_id in held]


# -- the SFT stage ----------------------------------------------------------------------------------
def fine_tune(cfg: Config, trainer: Trainer, samples: list[Sample], *, write: Callable[[dict[str, Any]], None],
              kind: str = "sft", step0: int = 0, label: str = "sft") -> dict[str, Any]:
    """train.sft.epochs over ``samples`` with ``trainer`` in SFT mode; held-out NLL before and after.
    ``write`` receives a metrics row per optimiser step (kind ``kind``) and the NLL rows (kind eval)."""
    s = cfg.train.sft
    train_s, held = split_heldout(samples, s.heldout_fraction, cfg.seed)
    t0 = time.perf_counter()
    out: dict[str, Any] = {f"{label}_transcripts": len(train_s), f"{label}_heldout_transcripts": len(held)}
    with sft_mode(trainer, cfg.train) as t:
        if held:
            out[f"{label}_heldout_nll_before"] = round(masked_nll(t, held), 4)
            write({"kind": "eval", "step": step0, "heldout_nll": out[f"{label}_heldout_nll_before"]})
        n = [step0]

        def on_step(m: dict[str, float]) -> None:
            n[0] += 1
            write({"kind": kind, "step": n[0], **m})

        steps = sft_epochs(t, train_s, epochs=s.epochs, batch=s.batch_transcripts, seed=cfg.seed, on_step=on_step)
        if held:
            out[f"{label}_heldout_nll_after"] = round(masked_nll(t, held), 4)
            write({"kind": "eval", "step": n[0], "heldout_nll": out[f"{label}_heldout_nll_after"]})
    out[f"{label}_steps"] = len(steps)
    out[f"{label}_loss_first"] = round(steps[0].get("loss/total", float("nan")), 4)
    out[f"{label}_loss_last"] = round(steps[-1].get("loss/total", float("nan")), 4)
    out[f"{label}_s"] = round(time.perf_counter() - t0, 1)
    return out


def sft(cfg: Config, *, files: Sequence[str] | None = None, overwrite: bool = False,
        console: Console | None = None) -> dict[str, Any]:
    """`arborl sft`: fine-tune the configured model on ``files`` (default train.sft.files) into runs/<name>/."""
    console = console or Console()
    files = list(files or cfg.train.sft.files)
    if not files:
        raise ConfigError("no transcripts: pass --data FILE.jsonl or set train.sft.files")
    check_loggers(cfg.report.loggers)
    set_mmap_threshold(cfg.train.malloc_mmap_threshold_mb << 20)
    run = RunDir(cfg.run_dir, cfg.datapool)
    if not overwrite:
        run.check_new()
    rows = read_transcripts(files)
    loaded = load_model(cfg.model)
    if loaded.tokenizer is None:
        raise ConfigError("SFT renders chat transcripts: the model needs a tokenizer (model.tiny_tokenizer=smollm2)")
    samples = transcript_samples(ChatRenderer(loaded.tokenizer, cfg.gateway.tool_prompt), rows)
    trainer = Trainer(loaded.model, sft_config(cfg.train))
    if overwrite:
        run.clear()
    run.path.mkdir(parents=True, exist_ok=True)
    (run.path / CONFIG_FILE).write_text(dump_config(cfg))
    metrics = RunLoggers(cfg.report.loggers, run.path, cfg.name, cfg.model_dump(mode="json"))
    console.print(f"arborl sft {cfg.name}: {len(samples)} transcripts from {len(files)} file(s), "
                  f"{cfg.train.sft.epochs} epoch(s), lora_rank {cfg.train.lora_rank}")
    try:
        summary = fine_tune(cfg, trainer, samples, write=metrics.write, kind="step", label="sft")
        summary["steps"] = summary["sft_steps"]
        save_checkpoint(run.checkpoint, trainer, {"step": summary["steps"], "version": 0, "summary": summary},
                        tokenizer=loaded.tokenizer)
    finally:
        metrics.close()
    (run.path / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    plot_run(metrics.read(), run.path / "curves.png", title=f"{cfg.name}: SFT per step")
    console.print(summary_table(summary, title=f"arborl sft {cfg.name}"))
    console.print(f"outputs in {run.path}/ (checkpoint/ is a Hugging Face model directory)", markup=False)
    return summary


# -- rejection sampling / expert iteration ----------------------------------------------------------
def passing(episodes: Sequence[Episode]) -> list[Episode]:
    """Exactly the episodes to keep: finished, usable, outcome 1 (the judge already applied)."""
    return [e for e in episodes if e.status == EpisodeStatus.FINISHED and usable(e)
            and e.reward_components.get("outcome", 0.0) >= 1.0]


async def sample_policy(ctl: Any, tasks: list[Task], k: int, temperature: float, tag: str) -> list[Episode]:
    """k episodes per task from the policy the controller serves (recorded, scored, judged)."""
    return await ctl.run_groups(tasks, k, temperature=temperature, tag=tag)


async def sample_endpoint(suite: Any, renderer: ChatRenderer, tasks: list[Task], k: int, cfg: Config
                          ) -> tuple[list[Sample], int]:
    """k episodes per task with the suite's white-box agent asking an OpenAI-compatible endpoint; returns
    the passing ones as samples (their transcripts rendered by ``renderer``) and the number sampled."""
    rj = cfg.train.sft.rejection
    sampling = {"temperature": rj.temperature, "max_tokens": cfg.rollout.max_tokens}
    kept: list[Sample] = []

    async def one(task: Task, i: int) -> None:
        client = EndpointClient(rj.base_url or "", rj.model or "default", os.environ.get(rj.api_key_env, "none"),
                                session_id=f"rs-{task.task_id}-{i}")
        try:
            outcome = await suite.agent(sampling)(task, client)
        finally:
            await client.aclose()
        if suite.score(task, outcome, []).get("outcome", 0.0) >= 1.0 and client.messages:
            kept.append(transcript_sample(renderer, client.messages, client.tools))

    await asyncio.gather(*(one(t, i) for t in tasks for i in range(k)))
    return kept, len(tasks) * k


async def rejection_rounds(cfg: Config, ctl: Any, trainer: Trainer, renderer: ChatRenderer,
                           write: Callable[[dict[str, Any]], None], console: Console) -> dict[str, Any]:
    """train.sft.rejection.rounds rounds: sample, keep the passing episodes, fine-tune, publish."""
    rj = cfg.train.sft.rejection
    out: dict[str, Any] = {}
    for rnd in range(rj.rounds):
        from arborl.run.controller import draw_tasks

        tasks = draw_tasks(ctl.suite, cfg.seed + 7919 * (rnd + 1), rj.tasks, rnd)
        if rj.base_url:
            samples, sampled = await sample_endpoint(ctl.suite.suite if hasattr(ctl.suite, "suite") else ctl.suite,
                                                     renderer, tasks, rj.k, cfg)
            kept = len(samples)
        else:
            episodes = await sample_policy(ctl, tasks, rj.k, rj.temperature, f"rs{rnd}")
            good = passing(episodes)
            samples, sampled, kept = episode_sft_samples(good), len(episodes), len(good)
        row = {"kind": "rejection", "step": rnd + 1, "sampled": sampled, "kept": kept,
               "pass_rate": kept / sampled if sampled else 0.0}
        if samples:
            res = await asyncio.to_thread(fine_tune, cfg, trainer, samples, write=write, kind="sft", label=f"rs{rnd + 1}")
            row.update({k: v for k, v in res.items() if isinstance(v, (int, float))})
            await ctl.publish()
            ctl.cancel(ctl.policy.on_version(ctl.version))
        write(row)
        console.print(f"  rejection round {rnd + 1}/{rj.rounds}: kept {kept} of {sampled} episodes", markup=False)
        out[f"rejection_round{rnd + 1}_kept"] = kept
        out[f"rejection_round{rnd + 1}_sampled"] = sampled
    return out


async def warm_start(cfg: Config, ctl: Any, trainer: Trainer, tokenizer: Any, write: Callable[[dict[str, Any]], None],
                     console: Console, summary: dict[str, Any]) -> None:
    """The stage `arborl train` runs before RL (train.sft): fine-tune on train.sft.files, then the rejection
    rounds; each publishes the fine-tuned weights to the engines (the RL policy starts from them)."""
    s = cfg.train.sft
    if tokenizer is None:
        raise ConfigError("train.sft renders chat transcripts: the model needs a tokenizer")
    renderer = ChatRenderer(tokenizer, cfg.gateway.tool_prompt)
    if s.files:
        samples = transcript_samples(renderer, read_transcripts(s.files))
        console.print(f"fine-tuning on {len(samples)} transcripts ({s.epochs} epoch(s)) before RL ...", markup=False)
        # no rollout until the fine-tuned weights are published, and that publish carries every weight (the
        # SFT trainer's first): the engines' own copy of the weights can go meanwhile
        await ctl.engines.release_memory(weights=True)
        res = await asyncio.to_thread(fine_tune, cfg, trainer, samples, write=write, kind="sft", label="sft")
        summary.update(res)
        console.print(f"  SFT: {res['sft_steps']} steps in {res['sft_s']} s, loss {res['sft_loss_first']} -> "
                      f"{res['sft_loss_last']}", markup=False)
        await ctl.publish()
        ctl.cancel(ctl.policy.on_version(ctl.version))
    if s.rejection.rounds:
        summary.update(await rejection_rounds(cfg, ctl, trainer, renderer, write, console))
