"""The training job ``arborl train`` runs, and the evaluation ``arborl eval`` runs.

runs/<name>/ gets config.yaml (written once; resumes append their changes to config.changes.yaml),
metrics.jsonl (one line per step and per evaluation), datapool.sqlite (every call of every episode),
checkpoint/ (a Hugging Face model directory plus optimiser, step and RNG state), summary.json and
curves.png. Nothing is written there before the config, the extension names, the data and reward
files (read and tried before the model loads), the model and (on resume) the checkpoint have been
checked; a new run that fails before its first step removes what it wrote (rundir.RunDir.starting).

SIGINT / SIGTERM stop the run after the step in flight, with a checkpoint and the summary; the
process then exits with 128 + the signal's number (130, 143) after printing how to resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from arborl.run.assemble import build_gateway, make_trainer
from arborl.cluster.supervise import Supervisor, serve_stop, supervised
from arborl.config import Config, ConfigError, dump_config
from arborl.run.controller import Controller
from arborl.extensions import check_extensions
from arborl.failpoints import failpoint
from arborl.heap import set_mmap_threshold
from arborl.models import load_model
from arborl.report import (
    MetricsLog,
    idle_reason,
    idle_warning,
    plot_run,
    plural,
    step_line,
    summary_table,
)
from arborl.report.lines import IDLE_ADVICE
from arborl.report.loggers import RunLoggers, check_loggers
from arborl.run_config import CHANGES_FILE, CONFIG_FILE, record_changes, resume_changes
from arborl.run.rundir import RunDir, resume_command
from arborl.run.stopping import RunStopped, StopRequest
from arborl.tasks import ConfiguredSuite, make_suite
from arborl.models.hf_dir import save_hf_dir
from arborl.train.checkpoint import existing_checkpoint, load_model_weights, plain_state
from arborl.train.mtp import resumed_config
from arborl.train.face import TrainerFace
from arborl.train.trainer import Trainer
from arborl.types import ArborlError


class IdleRunError(ArborlError):
    """The run stopped because too many steps in a row trained nothing (rollout.max_idle_steps)."""


class TokenDriftError(ArborlError):
    """The run stopped because too many of its calls drifted (gateway.max_drift_rate)."""


def _controller(cfg: Config, suite: ConfiguredSuite, trainer: TrainerFace | None, serving_model, loaded, run_dir: Path,
                version: int = 0, start_step: int = 0):
    """Gateway + engines serving ``serving_model`` (never the trainer's own module) as policy
    ``version``, and the controller around them."""
    built = build_gateway(
        cfg, loaded=dataclasses.replace(loaded, model=serving_model.eval(), exclusive=True), run_dir=run_dir,
        version=version
    )
    ctl = Controller(cfg, built.gateway, built.engines, built.pool, trainer, suite,
                     version=version, start_step=start_step)
    return built, ctl


def _say(console: Console, text: str, style: str | None = None) -> None:
    """A plain line: no markup, no wrapping in the middle of a phrase."""
    console.print(text, style=style, soft_wrap=True, markup=False, highlight=False)


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False,
          console: Console | None = None) -> dict[str, Any]:
    """Train ``cfg``; ``resume`` continues runs/<name>/ from its checkpoint, ``overwrite`` deletes an
    earlier run's outputs there first. Raises RunStopped after a signal, IdleRunError after
    rollout.max_idle_steps steps in a row that trained nothing (both after saving a checkpoint)."""
    console = console or Console()
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite deletes it: pass only one of them")
    if cfg.cluster.backend == "ray" and cfg.cluster.trainer_restarts > 0 and not supervised():
        # the trainer as a Ray actor, started again from its last checkpoint when it dies (cluster/supervise.py)
        run = RunDir(cfg.run_dir, cfg.datapool)
        out = Supervisor(cfg, _train_in_actor, run.has_checkpoint).run(resume=resume, overwrite=overwrite)
        if STOPPED_KEY in out:  # the actor stopped on our signal: say so here (its own output is Ray's to forward)
            msg, signum = out[STOPPED_KEY]
            _say(console, msg, style="yellow")
            raise RunStopped(msg, signum)
        return out
    check_extensions(cfg)
    check_loggers(cfg.report.loggers)
    set_mmap_threshold(cfg.train.malloc_mmap_threshold_mb << 20)
    run = RunDir(cfg.run_dir, cfg.datapool)
    changes: dict[str, tuple[Any, Any]] = {}
    if resume:
        run.check_resumable()
    from_checkpoint = resume and run.has_checkpoint()  # else a resume starts again at step 0, its committed episodes kept
    if resume:
        if (run.path / CONFIG_FILE).is_file():
            changes = resume_changes(run.path, cfg)
    elif not overwrite:
        run.check_new()
    suite = make_suite(cfg.rollout)  # data files read, reward file imported and tried: all before the model loads
    if not from_checkpoint and cfg.train.sft.files:  # the warm start's transcripts too: a missing file fails here
        from arborl.run.sft import read_transcripts

        read_transcripts(cfg.train.sft.files)

    r = cfg.rollout
    torch.manual_seed(cfg.seed)
    _say(console, f"arborl train {cfg.name}: {r.task} on {cfg.model.source}, {plural(r.steps, 'step')} x "
                  f"{plural(r.batch_tasks, 'task')} x {plural(r.group_size, 'episode')}")
    t_start = time.perf_counter()
    loaded = load_model(cfg.model)
    # LoRA for RL only (train.sft.full_finetune): the warm start trains every weight, the adapters come after it
    lora_after_sft = cfg.train.lora_rank > 0 and cfg.train.sft.full_finetune and bool(
        cfg.train.sft.files or cfg.train.sft.rejection.rounds)
    if lora_after_sft and from_checkpoint:  # the adapters of the checkpoint sit on the run's fine-tuned weights
        if not (run.sft_checkpoint / "config.json").is_file():
            raise ConfigError(f"{run.path} has no {run.sft_checkpoint.name}: its warm start did not finish, and with "
                              "train.sft.full_finetune the RL adapters need it; start the run again with --overwrite")
        load_model_weights(run.sft_checkpoint, loaded.model)
    serving = copy.deepcopy(loaded.model)  # the engines' copy: plain names even when training LoRA
    first_cfg = cfg.train.model_copy(update={"lora_rank": 0}) if lora_after_sft and not from_checkpoint else cfg.train
    trainer = make_trainer(loaded.model, first_cfg, cfg.cluster, temperature=r.temperature)  # one process or ranks
    start_step, version, summary_prev, extra, discarded = 0, 0, {}, {}, 0
    if from_checkpoint:
        extra = trainer.load(run.checkpoint)
        start_step, summary_prev = extra["step"], extra.get("summary", {})
        version = extra.get("version", start_step)
        serving.load_state_dict(trainer.engine_state())

    # every check passed: only now is the run directory written; a new run that fails before its first
    # step takes its outputs and the directory away again, so the same command reruns as it is
    with run.starting(fresh=not resume):
        # metrics.jsonl and the trackers of report.loggers
        metrics = RunLoggers(cfg.report.loggers, run.path, cfg.name, cfg.model_dump(mode="json"))
        with contextlib.closing(metrics):
            if not resume or not (run.path / CONFIG_FILE).exists():
                (run.path / CONFIG_FILE).write_text(dump_config(cfg))
                (run.path / CHANGES_FILE).unlink(missing_ok=True)
            if resume:
                record_changes(run.path, changes, start_step)
                for key, (old, new) in changes.items():
                    _say(console, f"  {key}: {old} -> {new} (recorded in {CHANGES_FILE})")
                aborted, discarded = run.abort_running_episodes()
                if aborted:
                    _say(console, f"  marked {plural(aborted, 'episode')} left running by the stopped process as "
                                  f"aborted ({plural(discarded, 'decoded token')} discarded; their groups run them again)")
                run.remove_stale_saves()
                metrics.truncate_after(start_step)
                _say(console, f"resumed from {run.checkpoint} at step {start_step}" if from_checkpoint else
                     "resumed at step 0: the run stopped before saving a checkpoint (rollout.checkpoint_every); "
                     "the episodes it committed are trained, not generated again")
                if start_step >= r.steps:
                    _say(console, f"the run has done its {plural(r.steps, 'step')}; to train further: --set rollout.steps=N")

            # a resumed run's mtp drafter and head trainer continue the checkpoint's head (train/mtp.py)
            ctl_cfg = resumed_config(cfg, existing_checkpoint(run.checkpoint)) if from_checkpoint else cfg
            launched, ctl = _controller(ctl_cfg, suite, trainer, serving, loaded, run.path, version, start_step)
            if ctl.mtp is not None and ctl_cfg is not cfg:
                ctl.mtp.load(existing_checkpoint(run.checkpoint))  # and its optimiser
            ctl.attempt = ctl.datapool.begin_attempt(start_step, discarded)
            if extra.get("stream"):  # the task stream where the checkpoint left it, its open groups started again
                restored = ctl.restore(extra["stream"])
                if restored:
                    _say(console, f"  {plural(restored, 'group')} in flight at the checkpoint started again "
                                  "(members committed since are read back, not generated again)")
            stop = StopRequest()
            if supervised():
                serve_stop(stop)  # in the trainer actor: the driver passes its Ctrl-C on (cluster/supervise.py)

            async def save(done: int, summary: dict[str, Any]) -> None:
                extra = {"step": done, "version": ctl.version, "summary": dict(summary), "stream": ctl.snapshot()}
                await asyncio.to_thread(trainer.save, run.checkpoint, extra, tokenizer=loaded.tokenizer,
                                        also=ctl.mtp.save if ctl.mtp is not None else None)

            async def sft_warm_start(summary: dict[str, Any]) -> None:
                from arborl.run.sft import warm_start

                nonlocal trainer
                await warm_start(cfg, ctl, trainer, loaded.tokenizer, metrics.write, console, summary)
                # the fine-tuned policy before RL, to evaluate, serve or start another RL run from
                await asyncio.to_thread(save_hf_dir, run.sft_checkpoint, plain_state(trainer), trainer.policy,
                                        loaded.tokenizer)
                summary["sft_checkpoint"] = str(run.sft_checkpoint)
                if lora_after_sft:  # RL trains LoRA adapters on the fully fine-tuned weights
                    trainer = ctl.trainer = make_trainer(trainer.policy, cfg.train, cfg.cluster, temperature=r.temperature)

            warm = sft_warm_start if not from_checkpoint and (cfg.train.sft.files or cfg.train.sft.rejection.rounds) else None
            try:
                summary, stopped, last = asyncio.run(_train_loop(
                    cfg, ctl, metrics, start_step, summary_prev, save, console, stop, saved=start_step if from_checkpoint else -1,
                    warm=warm))
            finally:
                launched.close()
                trainer.close()
                suite.shutdown()
    summary["wall_s"] = round(time.perf_counter() - t_start + summary_prev.get("wall_s", 0.0), 1)
    if stopped:
        summary["stopped"] = stopped
    (run.path / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    if cfg.report.curves:
        plot_run(metrics.read(), run.path / "curves.png", title=f"{cfg.name}: per step")
    console.print(summary_table(summary, title=f"arborl train {cfg.name}"))
    _say(console, f"outputs in {run.path}/")
    done = summary["steps"]
    if stop.requested:
        code = 128 + (stop.signum or 0)
        outputs = "summary.json and curves.png" if cfg.report.curves else "summary.json"
        msg = (f"stopped by {stop.name} after step {done} of {r.steps}: the checkpoint (step {done}) and {outputs} "
               f"are in {run.path}/. Resume with: {resume_command(run.path)}  "
               f"(exit status {code} = 128 + {stop.name})")
        if not supervised():  # in the trainer actor the driver says it
            _say(console, msg, style="yellow")
        raise RunStopped(msg, stop.signum or 0)
    if stopped == "drift":
        d = summary["drift"]
        raise TokenDriftError(
            f"stopped after step {done}: {d['drift_calls']} of {d['calls']} calls drifted ({d['drift_calls'] / d['calls']:.1%}"
            f" > gateway.max_drift_rate={cfg.gateway.max_drift_rate}): re-rendering their conversations gives other "
            f"token ids than the engine's. See where with `arborl audit {run.path}`; the checkpoint (step {done}) is saved")
    if stopped == "idle":
        first = done - r.max_idle_steps + 1
        raise IdleRunError(
            f"stopped after {plural(r.max_idle_steps, 'step')} in a row that trained nothing (steps {first}-{done}): "
            f"{idle_reason(last, r.group_size)}. To fix: {IDLE_ADVICE}. The checkpoint (step {done}) resumes with "
            f"changed settings, e.g. `{resume_command(run.path)} --set rollout.temperature=1.0`; "
            "rollout.max_idle_steps=0 never stops")
    return summary


STOPPED_KEY = "_stopped_by_signal"


def _train_in_actor(cfg: Config, *, resume: bool, overwrite: bool) -> dict[str, Any]:
    """``train`` in the trainer actor; a stop on the driver's signal comes back as {STOPPED_KEY: (message,
    signum)} (RunStopped does not survive pickling)."""
    try:
        return train(cfg, resume=resume, overwrite=overwrite)
    except RunStopped as e:
        return {STOPPED_KEY: (str(e), e.signum)}


@contextlib.contextmanager
def _step_display(console: Console, total: int, start: int) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Shows each step's metrics: a live bar on a terminal, else one plain line per step (what nohup
    and Slurm logs keep)."""
    if not console.is_terminal:
        yield lambda m: _say(console, step_line(m, total))
        return
    columns = [TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("train", total=total, completed=start, info="")

        def show(m: dict[str, Any]) -> None:
            loss = m.get("loss/total")
            progress.update(bar, advance=1, info=(
                f"reward {m['reward']:.2f}  success {m['success']:.2f}  {m['rollout_tokens_per_s']:.0f} tok/s  "
                f"step {m['step_s']:.0f}s  loss {'-' if loss is None else f'{loss:.3g}'}"))

        yield show


async def _evaluate(ctl: Controller, metrics: MetricsLog, step: int, label: str, summary: dict[str, Any],
                    console: Console) -> None:
    """Held-out success on each of the suite's held-out splits (eval; code_repair's eval_perturbed too), into
    metrics rows and ``summary`` as <split>_success_<label>."""
    for split in getattr(ctl.suite, "eval_splits", ("eval",)):
        ev = await ctl.evaluate(ctl.cfg.rollout.eval_tasks, split)
        metrics.write({"kind": "eval", "step": step, "split": split, "stage": label, **ev})
        summary[f"{split}_success_{label}"] = ev["eval_success"]
        console.print(f"  {split} success {label.replace('_', ' ')}: {ev['eval_success']:.3f}")


async def _train_loop(cfg: Config, ctl: Controller, metrics: MetricsLog, start_step: int, summary_prev: dict,
                      save: Callable[[int, dict[str, Any]], Awaitable[None]], console: Console, stop: StopRequest,
                      *, saved: int, warm: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                      ) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """Steps ``start_step``..rollout.steps; returns (summary, why it stopped early or None, last step's metrics)."""
    r = cfg.rollout
    summary: dict[str, Any] = dict(summary_prev)
    stop.install(asyncio.get_running_loop(), lambda name: _say(
        console, f"{name} received: stopping after the step in flight, then saving a checkpoint "
                 f"(send {name} again to stop at once without saving)", style="yellow"))
    stopped: str | None = None
    done, idle, last = start_step, 0, {}
    drift = [0, 0]  # drifted calls, calls, over this invocation's steps
    try:
        if start_step == 0 and r.eval_tasks:
            console.print(f"evaluating the starting policy on {plural(r.eval_tasks, 'held-out task')} ...")
            await _evaluate(ctl, metrics, 0, "before", summary, console)
        if start_step == 0 and warm is not None:  # train.sft: fine-tune before RL, then evaluate again
            await warm(summary)
            if r.eval_tasks:
                await _evaluate(ctl, metrics, 0, "after_sft", summary, console)
        with _step_display(console, r.steps, start_step) as show:
            for step in range(start_step, r.steps):
                if stop.requested:
                    break
                last = await ctl.train_step(step)
                metrics.write({"kind": "step", **last})
                show(last)
                done = step + 1
                idle = idle + 1 if last["samples"] == 0 else 0
                if idle:
                    _say(console, idle_warning(last, r.group_size, idle, r.max_idle_steps), style="yellow")
                if r.max_idle_steps and idle >= r.max_idle_steps:
                    stopped = "idle"
                    break
                drift = [drift[0] + last.get("drift_calls", 0), drift[1] + last.get("calls", 0)]
                bound = cfg.gateway.max_drift_rate
                if bound is not None and drift[1] and drift[0] / drift[1] > bound:
                    stopped = "drift"
                    summary["drift"] = {"drift_calls": drift[0], "calls": drift[1]}
                    break
                if r.eval_every and done % r.eval_every == 0 and done != r.steps:
                    ev = await ctl.evaluate(r.eval_tasks)
                    metrics.write({"kind": "eval", "step": done, **ev})
                if done == r.steps or (r.checkpoint_every and done % r.checkpoint_every == 0):
                    failpoint("step_end")
                    summary["steps"] = done
                    await save(done, summary)
                    saved = done
        if stop.requested:  # also when it came during the last step: the final evaluation is skipped
            stopped = stop.name
        summary["steps"] = done
        if stopped and saved != done:
            await save(done, summary)
        steps = [x for x in metrics.read() if x.get("kind") == "step"]
        if steps:
            summary["reward_first_step"] = steps[0]["reward"]
            summary["reward_last_step"] = steps[-1]["reward"]
            summary["mean_step_s"] = round(sum(x["step_s"] for x in steps) / len(steps), 2)
        if stopped is None and r.eval_tasks:
            console.print(f"evaluating the trained policy on {plural(r.eval_tasks, 'held-out task')} ...")
            await _evaluate(ctl, metrics, done, "after", summary, console)
            if "eval_success_before" in summary:
                summary["eval_success_gain"] = round(summary["eval_success_after"] - summary["eval_success_before"], 4)
    finally:
        stop.uninstall()
        await ctl.close()
    return summary, stopped, last


def load_policy_weights(checkpoint: str | Path, model: torch.nn.Module, cfg: Config) -> None:
    """A checkpoint's policy into the plain ``model``."""
    checkpoint = Path(checkpoint)
    if cfg.train.lora_rank > 0 and not (checkpoint / "config.json").is_file():
        # an older arborl's LoRA checkpoint holds the peft-wrapped model: rebuild it, merge
        trainer = Trainer(load_model(cfg.model).model, cfg.train)
        load_model_weights(checkpoint, trainer.model)
        model.load_state_dict(trainer.engine_state())
    else:
        load_model_weights(checkpoint, model)


def evaluate(cfg: Config, checkpoint: str | Path | None, *, console: Console | None = None) -> dict[str, Any]:
    """Held-out success of the configured model, or of a checkpoint's weights."""
    console = console or Console()
    check_extensions(cfg)
    suite = make_suite(cfg.rollout)  # data and reward checked before the model loads
    loaded = load_model(cfg.model)
    model = loaded.model
    if checkpoint is not None:
        load_policy_weights(checkpoint, model, cfg)
        cfg = resumed_config(cfg, Path(checkpoint))  # its mtp head drafts, when it holds one
    run_dir = cfg.run_dir / "eval"
    launched, ctl = _controller(cfg, suite, None, model, loaded, run_dir)
    try:
        ev = asyncio.run(ctl.evaluate(cfg.rollout.eval_tasks))
    finally:
        launched.close()
        suite.shutdown()
    ev = {"checkpoint": str(checkpoint) if checkpoint else None, **ev}
    console.print(summary_table(ev, title="arborl eval"))
    return ev
