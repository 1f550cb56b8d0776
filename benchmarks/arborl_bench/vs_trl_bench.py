"""``arborl bench vs-trl``: arborl against TRL's ``GRPOTrainer`` on the identical GRPO job.

The job (``tasks/arith.py``): single-turn arithmetic, B tasks x G samples per step, one model call
each, no tools, reward 1 for the right ``Answer: <number>``; SmolLM2-135M-Instruct in float32 on
CPU, full fine-tuning. Both frameworks get, per step, the same tasks (TRL's dataset is the tasks of
step 0, 1, ... in order, unshuffled), the same prompt token ids (checked: TRL's rendered prompt ids
are compared with the ids arborl's gateway sent to its engine), the same reward function, group
size, completion cap, sampling temperature (top-p 1, no top-k), learning rate (constant), AdamW
(betas, eps, no weight decay), gradient clip 1.0, PPO clip range (0.2 / 0.28), token-mean loss over
the batch (TRL ``loss_type="dapo"``), advantages normalised by the group std, no KL, and one
optimiser step per batch with pi_old = the policy itself (TRL: ``num_iterations=1``; arborl:
``old_logprobs="trainer"``). arborl keeps zero-variance groups (``drop_zero_variance=False``) so
both train on every sample.

One process, alternating: TRL step k runs, then (from TRL's ``on_step_end`` callback, outside
TRL's timed span) arborl step k, so both see the same machine load over the run. Per step:

* arborl: ``step_s`` of ``Controller.train_step``; generate = its ``rollout_s`` (episodes
  through the gateway and engine, scoring, data pool writes); train = the rest (samples, tree-
  packed PPO step, publishing the weights to the engine).
* TRL: step = ``on_step_begin`` -> ``on_step_end`` (the transformers loop calls
  ``training_step`` -- in which ``_prepare_inputs`` generates -- then clips and steps the
  optimiser between them); generate = the wall time of ``GRPOTrainer._generate_and_score_completions``
  (``model.generate``, rewards, advantages, padding; it computes no old/reference log-probs in this
  configuration), timed by wrapping the bound method; train = step - generate (the loss forward,
  backward, clipping, optimiser step, TRL's bookkeeping).

Ratios are arborl / TRL, medians of the per-step pairs (adjacent in time). Before the figures count,
both runs must have trained: every loss finite and the weights moved from the start
(``weights_rel_change`` = ||w - w0|| / ||w0|| over all parameters).

A second figure, the multi-turn calculator job, is only run where TRL's ``tools=`` can run it on
this model; ``multiturn_note`` says why not otherwise (checked against the installed TRL).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from arborl.tasks import arith
from arborl.types import Task

INSTALL_HINT = "TRL is not installed: pip install -e .[bench]   (or: pip install trl)"


@dataclass(frozen=True)
class Workload:
    """The one job both frameworks run; every shared hyper-parameter is read from here."""

    steps: int = 3
    batch_tasks: int = 8  # B prompts per step
    group_size: int = 4  # G samples per prompt
    max_tokens: int = 40  # completion cap (tokens)
    temperature: float = 0.7
    lr: float = 2e-5
    clip_low: float = 0.2
    clip_high: float = 0.28
    grad_clip: float = 1.0
    seed: int = 0

    @property
    def batch(self) -> int:
        return self.batch_tasks * self.group_size


def step_tasks(wl: Workload, step: int) -> list[Task]:
    """The tasks of ``step``: what arborl's ``Controller.train_step(step)`` draws (synchronous)."""
    from arborl.run.controller import draw_tasks

    return draw_tasks(arith.ArithSuite(), wl.seed, wl.batch_tasks, step)


# -- TRL's shape of the same job ------------------------------------------------------------------
def trl_rows(tasks: list[Task]) -> list[dict[str, Any]]:
    """Dataset rows for TRL's GRPOTrainer (conversational prompts; ``answer`` reaches the reward)."""
    return [{"prompt": arith.prompt_messages(t), "answer": t.metadata["answer"], "task_id": t.task_id} for t in tasks]


def completion_text(completion: Any) -> str:
    """TRL passes a conversational completion as a list of messages; the final text is the last
    assistant message's content."""
    if isinstance(completion, str):
        return completion
    texts = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return texts[-1] if texts else ""


def trl_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    return [arith.reward(a, completion_text(c)) for c, a in zip(completions, answer, strict=True)]



def trl_dataset_rows(wl: Workload) -> list[dict[str, Any]]:
    """TRL's training set: the tasks of steps 0, 1, ... in order (read unshuffled, B per step)."""
    return [row for k in range(wl.steps) for row in trl_rows(step_tasks(wl, k))]


def arborl_config(wl: Workload, runs_dir: str):
    from arborl.config import Config

    return Config.model_validate({
        "name": "vs-trl", "runs_dir": runs_dir, "seed": wl.seed,
        "model": {"source": "smollm2"},
        "engine": {"max_batch_size": wl.batch},
        "rollout": {"steps": wl.steps, "batch_tasks": wl.batch_tasks, "group_size": wl.group_size,
                    "temperature": wl.temperature, "top_p": 1.0, "max_tokens": wl.max_tokens, "max_turns": 1,
                    "eval_tasks": 0},
        "train": {"lr": wl.lr, "grad_clip": wl.grad_clip, "weight_decay": 0.0, "old_logprobs": "trainer",
                  "loss": {"kind": "ppo", "settings": {"clip_low": wl.clip_low, "clip_high": wl.clip_high}, "kl_coef": 0.0,
                           "aggregation": "token_mean"},
                  "advantage": {"estimator": "grpo", "std_normalize": True, "drop_zero_variance": False}},
        "scheduling": {"timeline": False},
    })


def trl_args(wl: Workload, output_dir: str) -> dict[str, Any]:
    """GRPOConfig keyword arguments of the same job (TRL defaults that would differ are set)."""
    return dict(
        output_dir=output_dir,
        max_steps=wl.steps,
        per_device_train_batch_size=wl.batch,
        gradient_accumulation_steps=1,
        num_generations=wl.group_size,
        max_completion_length=wl.max_tokens,
        temperature=wl.temperature, top_p=1.0, top_k=0,
        learning_rate=wl.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
        max_grad_norm=wl.grad_clip,
        loss_type="dapo", epsilon=wl.clip_low, epsilon_high=wl.clip_high, beta=0.0, num_iterations=1,
        scale_rewards="group",
        shuffle_dataset=False, seed=wl.seed,
        use_cpu=True, bf16=False, fp16=False,  # arborl trains in float32
        gradient_checkpointing=False,  # arborl does not checkpoint (TRL's default True costs ~20%)
        logging_steps=1, save_strategy="no", report_to=[], push_to_hub=False,
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0,
    )


# -- the arborl side ------------------------------------------------------------------------------
class ArborlSide:
    """Model, trainer, gateway + engine and controller of arborl's job, stepped one step at a time
    on a private event loop (so it can run from inside TRL's callbacks)."""

    def __init__(self, wl: Workload, runs_dir: str) -> None:
        from arborl.run.assemble import build_gateway
        from arborl.run.controller import Controller
        from arborl.models import load_model
        from arborl.train.trainer import Trainer

        self.cfg = arborl_config(wl, runs_dir)
        loaded = load_model(self.cfg.model)
        serving = copy.deepcopy(loaded.model)
        self.trainer = Trainer(loaded.model, self.cfg.train, temperature=self.cfg.rollout.temperature)
        self.launched = build_gateway(self.cfg, loaded=dataclasses.replace(loaded, model=serving.eval()),
                                      run_dir=self.cfg.run_dir)
        self.ctl = Controller(self.cfg, self.launched.gateway, self.launched.engines, self.launched.pool,
                              self.trainer, arith.ArithSuite())
        self.start = snapshot(self.trainer.model)
        self.steps: list[dict[str, float]] = []
        self.prompt_ids: dict[str, list[int]] = {}  # task id -> prompt token ids the engine saw
        original = self.ctl.run_groups

        async def capture(tasks, group_size, **kw):
            eps = await original(tasks, group_size, **kw)
            for e in eps:
                if e.calls:
                    self.prompt_ids.setdefault(e.task_id, list(e.calls[0].prompt_token_ids))
            return eps

        self.ctl.run_groups = capture
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vs-trl-arborl", daemon=True)
        self._thread.start()

    def step(self, k: int) -> dict[str, float]:
        m = asyncio.run_coroutine_threadsafe(self.ctl.train_step(k), self.loop).result()
        rec = {"step_s": m["step_s"], "generate_s": m["rollout_s"], "train_s": m["step_s"] - m["rollout_s"],
               "trainer_s": m["train_s"], "publish_s": m["publish_s"],
               "reward": m["reward"], "loss": m.get("loss/total", float("nan")),
               "gen_tokens": m["generated_tokens"], "zero_variance_groups": m["zero_variance_groups"],
               "packed_tokens": m.get("train/packed_tokens", 0.0), "flat_tokens": m.get("train/flat_tokens", 0.0)}
        self.steps.append(rec)
        return rec

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.launched.close()


# -- the TRL side ---------------------------------------------------------------------------------
def trl_callback(on_step: Callable[[int, dict[str, float]], None]):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Step wall time (on_step_begin -> on_step_end), the loss and reward TRL logs, and a hook
        that runs the other framework's step after TRL's step is timed."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.generate_s = 0.0
            self.gen_only_s = 0.0
            self.gen_tokens = 0
            self.steps: list[dict[str, float]] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, args, state, control, **kw):
            self.generate_s = self.gen_only_s = 0.0
            self.gen_tokens = 0
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_s = time.perf_counter() - self.t0
            rec = {"step_s": step_s, "generate_s": self.generate_s, "train_s": step_s - self.generate_s,
                   "generate_only_s": self.gen_only_s, "gen_tokens": self.gen_tokens}
            self.steps.append(rec)
            on_step(state.global_step - 1, rec)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.logs.append(dict(logs))

    return StepTimer()


def instrument(trainer, timer, prompt_ids: dict[str, list[int]], seen_tasks: list[list[str]]) -> None:
    """Time TRL's generation by wrapping its bound methods on this instance (no TRL code changed)."""
    gen_and_score = trainer._generate_and_score_completions
    generate = trainer._generate

    def timed_generate_and_score(inputs):
        t0 = time.perf_counter()
        seen_tasks.append([x["task_id"] for x in inputs])
        out = gen_and_score(inputs)
        timer.generate_s += time.perf_counter() - t0
        return out

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = generate(prompts)
        timer.gen_only_s += time.perf_counter() - t0
        prompt_list, completion_list = out[0], out[1]
        timer.gen_tokens += sum(len(c) for c in completion_list)
        for task_id, ids in zip(seen_tasks[-1], prompt_list):
            prompt_ids.setdefault(task_id, list(ids))
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer._generate = timed_generate


# -- checks ---------------------------------------------------------------------------------------
def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rel_change(model: torch.nn.Module, start: dict[str, torch.Tensor]) -> float:
    num = den = 0.0
    for n, p in model.named_parameters():
        if n in start:
            num += float((p.detach() - start[n]).double().pow(2).sum())
            den += float(start[n].double().pow(2).sum())
    return math.sqrt(num / den) if den else 0.0


def paired_ratio(a: list[float], b: list[float]) -> float | None:
    """Median over steps of a_k / b_k (None without pairs)."""
    pairs = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(pairs) if pairs else None


def summarize(arborl: list[dict[str, float]], trl: list[dict[str, float]]) -> dict[str, Any]:
    """Per-framework medians and arborl/TRL ratios from per-step records."""
    out: dict[str, Any] = {}
    for key in ("step_s", "generate_s", "train_s"):
        a = [r[key] for r in arborl]
        t = [r[key] for r in trl]
        out[f"arborl_{key}"] = round(statistics.median(a), 3) if a else None
        out[f"trl_{key}"] = round(statistics.median(t), 3) if t else None
        r = paired_ratio(a, t)
        out[f"ratio_{key.removesuffix('_s')}"] = round(r, 3) if r is not None else None
    return out


# -- multi-turn -----------------------------------------------------------------------------------
def multiturn_support(tokenizer) -> tuple[bool, str]:
    """Can the installed TRL's ``GRPOTrainer(tools=...)`` run the calculator agent on this model?

    Runs the checks ``GRPOTrainer.__init__`` runs on ``tools`` (installed TRL, same order):
    ``supports_tool_calling`` (the chat template must render assistant ``tool_calls`` and tool
    messages) and a response parser (``add_response_schema`` knows one for a list of templates:
    Qwen, Llama 3, GLM, GPT-OSS, ...) to find tool calls in completions."""
    try:
        import trl
        from trl.chat_template_utils import add_response_schema, supports_tool_calling
    except ImportError:
        return False, INSTALL_HINT
    tail = ("Running it would mean writing a tool-aware chat template and response parser for this model, after "
            "which TRL's prompts and tool turns would no longer be the token ids arborl's gateway renders (arborl "
            "writes the tool convention into the system prompt and stitches turns token by token), so it would not "
            "be the same job.")
    head = f"not run: TRL {trl.__version__} GRPOTrainer(tools=...) refuses SmolLM2-135M-Instruct's chat template"
    if not supports_tool_calling(tokenizer):
        return False, (f"{head}: the template drops assistant `tool_calls` (it renders only `content`), so "
                       f"`supports_tool_calling` is false and GRPOTrainer raises 'The provided chat template does not "
                       f"support tool calling'. {tail}")
    tok = copy.deepcopy(tokenizer)
    if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
        try:
            add_response_schema(tok)
        except ValueError:
            return False, (f"{head}: TRL has no response parser for it ('Unrecognized chat template, failed to add "
                           f"response schema'), so it cannot find tool calls in completions. {tail}")
    return True, "TRL can parse tool calls with this chat template"


# -- the benchmark --------------------------------------------------------------------------------
def run(quick: bool, console: Console) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        console.print(f"[red]{escape(INSTALL_HINT)}[/red]")  # escape: rich would eat "[bench]"
        return {"error": "trl not installed", "install": "pip install -e .[bench]", "arborl_step_s": None,
                "trl_step_s": None, "ratio_step": None, "ratio_generate": None, "ratio_train": None}
    try:  # huggingface_hub reads HF_HUB_OFFLINE at import: make sure nothing reaches the hub
        import huggingface_hub.constants as hf_constants

        hf_constants.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover
        pass
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arborl.models.loading import ensure_smollm2_dir

    wl = Workload(steps=3 if quick else 6)
    torch.manual_seed(wl.seed)
    model_dir = str(ensure_smollm2_dir("~/.cache/arborl/models"))
    console.print(f"[bold]arborl bench vs-trl[/bold]: TRL {trl.__version__}, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads; SmolLM2-135M-Instruct ({model_dir}); {wl.steps} steps x "
                  f"{wl.batch_tasks} prompts x {wl.group_size} samples, <= {wl.max_tokens} tokens, "
                  f"T={wl.temperature}, lr={wl.lr}")

    tmp = tempfile.TemporaryDirectory(prefix="arborl-vs-trl-")
    t_load = time.perf_counter()
    side_a = ArborlSide(wl, tmp.name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trl_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trl_start = snapshot(trl_model)
    trl_prompt_ids: dict[str, list[int]] = {}
    trl_tasks: list[list[str]] = []

    def between(k: int, trl_rec: dict[str, float]) -> None:
        a = side_a.step(k)
        console.print(f"  step {k + 1}/{wl.steps}: TRL {trl_rec['step_s']:.1f}s (generate {trl_rec['generate_s']:.1f}s)"
                      f" | arborl {a['step_s']:.1f}s (generate {a['generate_s']:.1f}s)  "
                      f"reward arborl {a['reward']:.2f}")

    timer = trl_callback(between)
    trainer = GRPOTrainer(
        model=trl_model, reward_funcs=trl_reward, args=GRPOConfig(**trl_args(wl, f"{tmp.name}/trl")),
        train_dataset=Dataset.from_list(trl_dataset_rows(wl)), processing_class=tokenizer, callbacks=[timer],
    )
    instrument(trainer, timer, trl_prompt_ids, trl_tasks)
    console.print(f"  both loaded in {time.perf_counter() - t_load:.0f}s; running TRL step k, then arborl step k ...")
    t_run = time.perf_counter()
    try:
        trainer.train()
    finally:
        side_a.close()
    run_s = time.perf_counter() - t_run

    # -- checks: same work, both trained ------------------------------------------------------------
    a_steps, t_steps = side_a.steps, timer.steps
    expected = [[t.task_id for t in step_tasks(wl, k) for _ in range(wl.group_size)] for k in range(wl.steps)]
    same_tasks = trl_tasks == expected
    common = sorted(set(trl_prompt_ids) & set(side_a.prompt_ids))
    same_prompts = bool(common) and all(trl_prompt_ids[t] == side_a.prompt_ids[t] for t in common) and \
        len(common) == wl.steps * wl.batch_tasks
    trl_losses = [lg["loss"] for lg in timer.logs]
    a_losses = [r["loss"] for r in a_steps]
    a_change = rel_change(side_a.trainer.model, side_a.start)
    t_change = rel_change(trainer.model, trl_start)
    trained = {
        "arborl": all(math.isfinite(x) for x in a_losses) and len(a_losses) == wl.steps and a_change > 0,
        "trl": all(math.isfinite(x) for x in trl_losses) and len(trl_losses) == wl.steps and t_change > 0,
    }
    a_gen = sum(r["gen_tokens"] for r in a_steps)
    t_gen = sum(r["gen_tokens"] for r in t_steps)

    table = Table(title="arborl vs TRL GRPOTrainer, same job (seconds per step)")
    for col in ("step", "arborl step", "arborl gen", "arborl train", "TRL step", "TRL gen", "TRL train", "ratio step"):
        table.add_column(col, justify="right")
    for k, (a, t) in enumerate(zip(a_steps, t_steps)):
        table.add_row(str(k + 1), f"{a['step_s']:.2f}", f"{a['generate_s']:.2f}", f"{a['train_s']:.2f}",
                      f"{t['step_s']:.2f}", f"{t['generate_s']:.2f}", f"{t['train_s']:.2f}",
                      f"{a['step_s'] / t['step_s']:.3f}")
    console.print(table)

    mt_ok, mt_note = multiturn_support(tokenizer)
    figures: dict[str, Any] = {
        **summarize(a_steps, t_steps),
        "steps": wl.steps, "batch_tasks": wl.batch_tasks, "group_size": wl.group_size,
        "max_tokens": wl.max_tokens, "temperature": wl.temperature, "lr": wl.lr,
        "trl_version": trl.__version__, "torch_threads": torch.get_num_threads(),
        "same_tasks": same_tasks, "same_prompt_ids": same_prompts,
        "arborl_trained": trained["arborl"], "trl_trained": trained["trl"],
        "arborl_weights_rel_change": float(f"{a_change:.3e}"), "trl_weights_rel_change": float(f"{t_change:.3e}"),
        "arborl_loss": [float(f"{x:.4g}") for x in a_losses], "trl_loss": [float(f"{x:.4g}") for x in trl_losses],
        "arborl_reward": [round(r["reward"], 3) for r in a_steps],
        "trl_reward": [round(lg.get("reward", float("nan")), 3) for lg in timer.logs],
        "arborl_gen_tokens": a_gen, "trl_gen_tokens": t_gen,
        "trl_generate_only_s": round(statistics.median(r["generate_only_s"] for r in t_steps), 3) if t_steps else None,
        "arborl_tree_token_ratio": round(sum(r["flat_tokens"] for r in a_steps)
                                         / max(1.0, sum(r["packed_tokens"] for r in a_steps)), 2),
        "run_s": round(run_s, 1),
        "multiturn": "run" if mt_ok else "not run",
        "multiturn_note": mt_note,
    }
    if a_gen and t_gen:  # generation is sampled independently: report the per-token figure too
        figures["ratio_generate_per_token"] = round(
            (sum(r["generate_s"] for r in a_steps) / a_gen) / (sum(r["generate_s"] for r in t_steps) / t_gen), 3)
    ok = same_tasks and same_prompts and trained["arborl"] and trained["trl"]
    figures["valid"] = ok
    console.print(f"same tasks per step: {same_tasks}; same prompt token ids: {same_prompts}; "
                  f"trained: arborl {trained['arborl']} (|dw|/|w| {a_change:.2e}), TRL {trained['trl']} "
                  f"(|dw|/|w| {t_change:.2e})")
    console.print(f"generated tokens: arborl {a_gen}, TRL {t_gen} (sampled independently)")
    console.print(f"multi-turn calculator: {escape(mt_note)}")
    if not ok:
        console.print("[red]the comparison is not valid (see the checks above): do not quote these ratios[/red]")
    console.print(f"ratio_step {figures['ratio_step']} (goal <= 0.5), ratio_generate {figures['ratio_generate']}, "
                  f"ratio_train {figures['ratio_train']}")
    tmp.cleanup()
    return figures
