"""``arborl bench memory [--quick]``: where the code-repair job's memory goes, phase by phase, today's
settings against the lean ones, and LoRA RL of a SmolLM2-1.7B-shaped model on this machine.

1. **The job's process, emulated at its shapes** (configs/code_repair.yaml: SmolLM2-135M float32, the
   engine in the trainer's process with the job's EngineConfig, 16 episodes = 4 groups x 4 of up to
   2048 tokens over 4 turns, SFT micro-batches of 2048-token transcripts, then LoRA GRPO). The token
   ids are drawn at random: memory depends on shapes, not on text, and no sandbox is needed. Each
   variant runs in its own process; per phase (rollout, sft, publish, rl rollout, rl train, rl publish)
   the process's peak resident memory is read from the kernel (VmHWM, reset before the phase through
   /proc/self/clear_refs) and the components are counted from the objects that hold them (trainer
   weights, gradients, AdamW state, engine module, packed weights, KV cache, prefix cache).
   - ``before``: today's behaviour -- whole logits (train.logits_chunk_tokens=0) of micro-batches of
     4096 tokens under activation checkpointing (the job's config then), every KV slot
     allocated at start, the last SFT step's gradients kept through RL, every published tensor cloned,
     the old packed weights alive while the new ones are built;
   - ``after``: the defaults now (logits chunk by chunk, KV rows as sequences run, gradients freed,
     frozen base tensors published by reference, packed weights rebuilt in place, the engine's Linear
     weights only in its packs, its prefix cache and spare KV rows freed while the trainer trains, and
     after RL steps the LoRA adapters alone published, served on the engine's base: train.lora_sync);
   - ``ckpt``: ``after`` with every layer checkpointed, micro-batches of 4096 tokens and logits chunks of
     1024 (``CKPT``: the job's config before the lean backward, ``models/lean_backward.py``): its memory and
     the time checkpointing costs (``ckpt_time_ratio_*``, with / without).
2. **LoRA GRPO on a SmolLM2-1.7B-shaped model** (its config, random weights built here; bf16 base,
   float32 adapters, activation checkpointing): one full step -- 4 episodes (prompt + decode) on the
   built-in engine, the GRPO train step on them, the adapters published to the engine (which serves them
   on the base it holds; ``sync_mb``) -- with
   its peak resident memory and the time of each part. ``--quick`` shortens the episodes.

3. **The whole job** (not with ``--quick``): ``arborl train configs/code_repair.yaml`` as a user runs it, the
   peak resident memory of its process tree (workers and sandboxes included) against the 23.0 GB the issue
   measured before the memory work (``job_peak_rss_gb``, ``job_peak_rss_ratio``), its wall time and its
   held-out figures. Its demonstrations must exist (``make code-repair-demos``).

Last line: ``peak_rss_gb_sft``, ``peak_rss_gb_rl`` (after), ``peak_rss_ratio`` (after / before of part 1's
emulation: it cannot undo the fixes that have no knob, so the whole job's ratio is ``job_peak_rss_ratio``),
``logits_bytes_per_microbatch`` (the logits that exist at once in a training micro-batch, after; before in
``logits_bytes_per_microbatch_before``), ``activation_checkpointing`` (the job's config),
``peak_rss_gb_{sft,rl}_ckpt`` and ``ckpt_time_ratio_{sft,rl_train}`` (the ``ckpt`` variant's peaks, and its
seconds / after's), ``lora_1p7b_step_s``, ``lora_1p7b_peak_rss_gb``, ``job_peak_rss_gb`` and
``job_peak_rss_ratio`` (None with ``--quick``).
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

GB = 1e9
GROUPS, GROUP_SIZE = 4, 4
SHARED_FRACTION = 0.3  # of the context: system prompt, tools and task, what a group's episodes share
TURNS = 4
SMOLLM2_1P7B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=130000.0, tie_word_embeddings=True)
# the job's config until 2026-12-07: every layer checkpointed, micro-batches of 4096, logits chunks of 1024
CKPT = {"activation_checkpointing": True, "activation_checkpointing_layers": None, "micro_batch_tokens": 4096,
        "logits_chunk_tokens": 1024}


# -- the kernel's figures ----------------------------------------------------------------------------
_LIFETIME = [0]  # the largest VmHWM seen before a reset


def reset_peak() -> None:
    """Start a new peak: the kernel's VmHWM is set back to the current resident memory (the old peak is
    kept for ``peak_rss_lifetime``)."""
    _LIFETIME[0] = max(_LIFETIME[0], peak_rss())
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_lifetime() -> int:
    return max(_LIFETIME[0], peak_rss())


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return _status("VmHWM")


def rss() -> int:
    return _status("VmRSS")


# -- what holds the memory -----------------------------------------------------------------------------
def _tensor_bytes(tensors) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if not torch.is_tensor(t) or not t.numel():
            continue
        try:
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        except NotImplementedError:  # an opaque tensor (oneDNN's reordered weight): its elements
            seen[(id(t), 0)] = t.numel() * t.element_size()
    return sum(seen.values())


def components(trainer, engine, extra: dict[str, int] | None = None) -> dict[str, float]:
    """GB held by each part, counted from the objects (a storage shared by two parts counts for the first)."""
    trainer_w = _tensor_bytes(trainer.model.parameters())
    grads = _tensor_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None)
    opt = _tensor_bytes(t for st in trainer.optimizer.state.values() for t in st.values())
    own = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    engine_w = _tensor_bytes(p for p in engine.model.parameters() if p.untyped_storage().data_ptr() not in own)
    packed = 0
    if engine.runner.linear is not None:
        packed = _tensor_bytes(t for w in engine.runner.linear.packed_groups().values()
                               for t in (w.onednn, w.panels, w.bias, w.scales) if t is not None)
    kv = engine.runner.kv.nbytes
    prefix = _tensor_bytes(n.value for n in engine.prefix_cache.tree.dfs() if n.value is not None)
    out = {"trainer_weights": trainer_w, "gradients": grads, "optimizer": opt, "engine_module": engine_w,
           "engine_packed": packed, "kv_cache": kv, "prefix_cache": prefix, **(extra or {})}
    return {k: round(v / GB, 3) for k, v in out.items()}


# -- the job's shapes ----------------------------------------------------------------------------------
def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def rollout(engine, rng: random.Random, vocab: int, max_len: int, decode: int, temperature: float) -> int:
    """16 episodes in 4 groups, TURNS turns each: every turn's prompt is the episode's history (the engine
    reuses its cached prefix), a tool output follows each completion; the histories grow to ``max_len``.
    Returns the tokens decoded."""
    from arborl.types import GenerateRequest, SamplingParams

    prompt = int(max_len * SHARED_FRACTION)
    per_turn = (max_len - prompt) // TURNS
    shared = [_ids(rng, prompt, vocab) for _ in range(GROUPS)]
    history = [list(shared[g]) for g in range(GROUPS) for _ in range(GROUP_SIZE)]
    decoded = 0
    for turn in range(TURNS):
        params = SamplingParams(temperature=temperature, max_tokens=decode, ignore_eos=True, seed=turn)
        reqs = [GenerateRequest(list(h), params, group_id=f"g{i // GROUP_SIZE}") for i, h in enumerate(history)]
        for h, res in zip(history, engine.generate(reqs)):
            h.extend(res.token_ids)
            decoded += len(res.token_ids)
            room = min(per_turn, max_len - decode - len(h)) if turn < TURNS - 1 else 0
            h.extend(_ids(rng, max(room - decode, 0), vocab))  # the tool's output
    return decoded


def transcripts(rng: random.Random, n: int, length: int, vocab: int, *, group: int = 1, shared: int = 0):
    """``n`` samples of ``length`` tokens, loss on the model's turns (a quarter of the tokens after the
    shared part), ``group`` per group sharing their first ``shared`` tokens."""
    from arborl.types import Sample

    out = []
    for g in range(0, n, group):
        prefix = _ids(rng, shared, vocab)
        for k in range(min(group, n - g)):
            toks = prefix + _ids(rng, length - shared, vocab)
            mask = [0] * shared + [1 if (i // 64) % 4 == 0 else 0 for i in range(length - shared)]
            adv = 1.0 if k % 2 else -1.0
            out.append(Sample(episode_id=f"e{g + k}", group_id=f"g{g}", token_ids=toks, loss_mask=mask,
                              rollout_logprobs=[-1.0 * m for m in mask], versions=[0 if m else -1 for m in mask],
                              chunk_ids=[0] * length, advantages=[adv * m for m in mask]))
    return out


def _config_path() -> Path:
    here = Path(__file__).resolve().parents[2] / "configs" / "code_repair.yaml"
    return here if here.is_file() else Path("configs/code_repair.yaml")


def job_child(variant: str, quick: bool, overrides: list[str] | None = None) -> dict[str, Any]:
    """The job's phases in this process (module docstring); per phase its peak and the components."""
    from arborl.config import load_config
    from arborl.engine.engine import LLMEngine
    from arborl.models import load_model
    from arborl.run.assemble import make_trainer
    from arborl.train.sft import sft_epochs, sft_mode

    before = variant == "before"
    cfg = load_config(str(_config_path()), list(overrides or []))  # the tests' own: a tiny model
    tcfg = cfg.train
    if before:  # whole logits; the job's config then: checkpointing on, micro-batches of 4096 tokens
        tcfg = tcfg.model_copy(update={**CKPT, "logits_chunk_tokens": 0})
    if variant == "ckpt":
        tcfg = tcfg.model_copy(update=CKPT)
    rng = random.Random(0)
    torch.manual_seed(0)
    loaded = load_model(cfg.model)
    vocab = loaded.vocab_size
    max_len = cfg.engine.max_seq_len
    serving = copy.deepcopy(loaded.model)  # the job's engine copy (run/job.py)
    engine = LLMEngine(serving, cfg.engine, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer, seed=0,
                       owns_model=not before)  # as the job's engine (build_gateway): its model is its own
    if before:  # today's engine allocated every slot's rows at start
        engine.runner.kv.ensure(1, cfg.engine.max_batch_size)
    trainer = make_trainer(loaded.model, tcfg.model_copy(update={"lora_rank": 0}), temperature=cfg.rollout.temperature)
    phases: dict[str, dict[str, Any]] = {}
    decode = 8 if quick else cfg.rollout.max_tokens
    setup_peak = round(peak_rss() / GB, 3)

    def phase(name: str, fn) -> Any:
        reset_peak()
        t0 = time.perf_counter()
        out = fn()
        phases[name] = {"peak_gb": round(peak_rss() / GB, 3), "seconds": round(time.perf_counter() - t0, 1),
                        "components_gb": components(trainer, engine)}
        return out

    def publish(version: int) -> None:
        # now: a LoRA trainer sends its adapters alone once the engine holds its base (train.lora_sync)
        adapters = trainer.adapter_state() if not before and version > 1 else None
        state = adapters if adapters is not None else trainer.engine_state()
        old = None
        if before:  # today: every tensor cloned, and the old packed weights alive while the new are built
            state = {k: v.clone() for k, v in state.items()}
            old = dict(engine.runner.linear.packed_groups()) if engine.runner.linear is not None else None
        engine.update_weights(state, version)
        del state, old

    phase("rollout", lambda: rollout(engine, rng, vocab, max_len, decode, cfg.rollout.temperature))
    n_sft = 2 if quick else cfg.train.sft.batch_transcripts
    sft_samples = transcripts(rng, n_sft, max_len, vocab)
    kept: list[torch.Tensor] = []

    def sft() -> None:
        if not before:  # the warm start: an idle engine's caches, and its weights (the next publish carries all)
            engine.release_memory(weights=True)
        with sft_mode(trainer, tcfg) as t:
            sft_epochs(t, sft_samples, epochs=1, batch=n_sft)
            if before:  # today: the last SFT step's gradients stayed on the weights through RL
                kept.extend(p.grad for p in t.params if p.grad is not None)

    phase("sft", sft)
    if kept:
        for p, g in zip(trainer.params, kept):
            p.grad = g
    phase("publish_sft", lambda: publish(1))
    trainer = make_trainer(trainer.policy, tcfg, temperature=cfg.rollout.temperature)  # LoRA on the SFT weights
    phase("rl_rollout", lambda: rollout(engine, rng, vocab, max_len, decode, cfg.rollout.temperature))
    n_rl = GROUP_SIZE if quick else GROUPS * GROUP_SIZE
    rl_samples = transcripts(rng, n_rl, max_len, vocab, group=GROUP_SIZE, shared=int(max_len * SHARED_FRACTION))
    def rl_train() -> dict:
        if not before:
            engine.release_memory()
        return trainer.train_step(rl_samples)

    metrics = phase("rl_train", rl_train)
    phase("rl_publish", lambda: publish(2))
    shape = trainer.policy.get_input_embeddings().weight.shape
    rows = max_len * 2 if tcfg.logits_chunk_tokens <= 0 else tcfg.logits_chunk_tokens  # a 4096-token micro-batch
    return {"variant": variant, "phases": phases, "process_peak_gb": round(peak_rss_lifetime() / GB, 3),
            "activation_checkpointing": tcfg.activation_checkpointing, "micro_batch_tokens": tcfg.micro_batch_tokens,
            "setup_peak_gb": setup_peak,
            "logits_bytes_per_microbatch": min(rows, tcfg.micro_batch_tokens) * shape[0] * 4,
            "rl_packed_tokens": metrics.get("train/packed_tokens"), "sft_transcripts": n_sft, "rl_samples": n_rl,
            "estimate_gb": _estimate(trainer, tcfg.micro_batch_tokens)}


def _estimate(trainer, tokens: int) -> float | None:
    need = trainer.check_memory(tokens)
    return round(need.total / GB, 3) if need is not None else None


# -- SmolLM2-1.7B's shape, LoRA ------------------------------------------------------------------------
def big_child(quick: bool, shape_overrides: dict[str, Any] | None = None,
              lengths: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """One LoRA GRPO step of the 1.7B-shaped model: rollout on the engine, train, publish (docstring)."""
    from transformers import LlamaConfig

    from arborl.config import EngineConfig, TrainConfig
    from arborl.engine.engine import LLMEngine
    from arborl.models.quantize import to_serving_dtype
    from arborl.train.trainer import Trainer

    rng = random.Random(1)
    torch.manual_seed(0)
    baseline = rss()  # the interpreter, torch and transformers
    t0 = time.perf_counter()
    shape = LlamaConfig(**{**SMOLLM2_1P7B, **(shape_overrides or {})})
    model = _random_bf16(shape)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    episodes, prompt, decode = lengths or ((2, 512, 8) if quick else (4, 1024, 32))
    serving = to_serving_dtype(copy.deepcopy(model), "bfloat16")  # bf16 Linear weights, float32 elsewhere
    engine = LLMEngine(serving, EngineConfig(max_batch_size=episodes, max_seq_len=prompt + decode + 8), eos_token_ids=[0],
                       owns_model=True)  # its Linear weights only in its bf16 panels
    tcfg = TrainConfig(lora_rank=16, lora_alpha=32, lr=2e-4, activation_checkpointing=True)
    trainer = Trainer(model, tcfg, temperature=0.5)
    after_setup = rss()
    reset_peak()
    from arborl.types import GenerateRequest, SamplingParams

    t_roll = time.perf_counter()
    shared = _ids(rng, prompt // 2, shape.vocab_size)
    reqs = [GenerateRequest(shared + _ids(rng, prompt - prompt // 2, shape.vocab_size),
                            SamplingParams(temperature=0.5, max_tokens=decode, ignore_eos=True, seed=i), group_id="g")
            for i in range(episodes)]
    results = engine.generate(reqs)
    roll_s = time.perf_counter() - t_roll
    samples = []
    from arborl.types import Sample

    for i, (req, res) in enumerate(zip(reqs, results)):
        toks = req.prompt_token_ids + res.token_ids
        mask = [0] * len(req.prompt_token_ids) + [1] * len(res.token_ids)
        adv = 1.0 if i % 2 else -1.0
        samples.append(Sample(episode_id=f"e{i}", group_id="g", token_ids=toks, loss_mask=mask,
                              rollout_logprobs=[0.0] * len(req.prompt_token_ids) + list(res.logprobs),
                              sample_logprobs=[0.0] * len(req.prompt_token_ids) + list(res.sample_logprobs),
                              versions=[0 if m else -1 for m in mask], chunk_ids=[0] * len(toks),
                              advantages=[adv * m for m in mask]))
    t_train = time.perf_counter()
    metrics = trainer.train_step(samples)
    train_s = time.perf_counter() - t_train
    t_sync = time.perf_counter()
    published = trainer.adapter_state()  # the engine holds the base: the adapters alone (train.lora_sync)
    engine.update_weights(published, 1)
    sync_s = time.perf_counter() - t_sync
    sync_mb = sum(v.nbytes for v in published.values()) / 1e6
    step_peak = peak_rss()
    return {"params_b": round(params / 1e9, 3), "build_s": round(build_s, 1), "setup_rss_gb": round(after_setup / GB, 3),
            "baseline_rss_gb": round(baseline / GB, 3),
            "setup_bytes_per_param": round((after_setup - baseline) / params, 2),
            "peak_rss_gb": round(peak_rss_lifetime() / GB, 3), "step_peak_rss_gb": round(step_peak / GB, 3),
            "rollout_s": round(roll_s, 1), "train_s": round(train_s, 1), "sync_s": round(sync_s, 2), "sync_mb": round(sync_mb, 2),
            "step_s": round(roll_s + train_s + sync_s, 1), "episodes": episodes,
            "episode_tokens": prompt + decode, "loss_tokens": metrics.get("train/loss_tokens"),
            "packed_tokens": metrics.get("train/packed_tokens"), "finite_loss": bool(metrics.get("loss/total") == metrics.get("loss/total"))}


def _random_bf16(shape) -> torch.nn.Module:
    """The model of ``shape`` with random weights, built layer by layer in bf16 (no float32 copy of the whole)."""
    from transformers import LlamaForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(shape)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


# -- the bench -----------------------------------------------------------------------------------------
# -- the whole job, as a user runs it -----------------------------------------------------------------
JOB_PEAK_BEFORE_GB = 23.0  # issue 46: `arborl train configs/code_repair.yaml` before the memory work (5-second sampler)


def whole_job(config: str | Path, overrides: list[str], runs_dir: Path, name: str = "job") -> dict[str, Any]:
    """``arborl train CONFIG`` in its own process, as a user starts it: the peak resident memory of its
    process tree (rollout workers and sandboxes included; psutil every second), its wall time, and the
    held-out figures of its summary.json."""
    from arborl.config import load_config
    from arborl_bench.progress_bench import arborl, sets

    missing = [f for f in load_config(str(config), overrides).train.sft.files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"{config} trains on {missing}, which do not exist: run `make code-repair-demos` first")
    runs_dir.mkdir(parents=True, exist_ok=True)
    log = runs_dir / f"{name}.log"
    t0 = time.perf_counter()
    code, peak = arborl("train", str(config), *sets([f"runs_dir={runs_dir}", f"name={name}", *overrides]), "--overwrite",
                        log=log)
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"arborl train {config} failed ({code}): see {log}")
    summary = json.loads((runs_dir / name / "summary.json").read_text())
    return {"peak_rss_gb": round(peak / GB, 3), "wall_s": round(wall, 1),
            "eval": {k: v for k, v in summary.items() if k.startswith("eval_")}}


def _child(args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "arborl_bench.memory_bench", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def run(quick: bool, console) -> dict:
    from rich.table import Table

    q = ["--quick"] if quick else []
    jobs = {}
    for variant in ("before", "after", "ckpt"):
        console.print(f"the job's phases, {variant} ...")
        jobs[variant] = _child(["job", variant, *q])
    table = Table(title="code-repair job, peak resident memory by phase (GB)")
    table.add_column("phase")
    for v in jobs:
        table.add_column(v, justify="right")
    table.add_column("after / before", justify="right")
    for name in jobs["after"]["phases"]:
        b, a = jobs["before"]["phases"][name]["peak_gb"], jobs["after"]["phases"][name]["peak_gb"]
        table.add_row(name, *(f"{jobs[v]['phases'][name]['peak_gb']:.2f}" for v in jobs), f"{a / b:.2f}")
    console.print(table)
    for name in ("sft", "rl_train"):
        a, c = jobs["after"]["phases"][name], jobs["ckpt"]["phases"][name]
        console.print(f"{name} with activation checkpointing (4096-token micro-batches): peak {c['peak_gb']:.2f} GB "
                      f"(without: {a['peak_gb']:.2f}), time {c['seconds']:.1f} s (without: {a['seconds']:.1f} s)")
    comp = Table(title="what holds it after each phase, after (GB)")
    comp.add_column("phase")
    keys = list(next(iter(jobs["after"]["phases"].values()))["components_gb"])
    for k in keys:
        comp.add_column(k, justify="right")
    for name, ph in jobs["after"]["phases"].items():
        comp.add_row(name, *(f"{ph['components_gb'][k]:.2f}" for k in keys))
    console.print(comp)
    console.print("LoRA GRPO step of a SmolLM2-1.7B-shaped model (bf16 base) ...")
    big = _child(["big", *q])
    console.print(big)
    job = None
    if not quick:
        console.print("the whole job, as a user runs it (arborl train configs/code_repair.yaml, ~30 minutes) ...")
        job = whole_job(_config_path(), [], Path("runs/bench-memory"))
        console.print(job)

    def peak(v: str, names: tuple[str, ...]) -> float:
        return max(jobs[v]["phases"][n]["peak_gb"] for n in names)

    rl = ("rl_rollout", "rl_train", "rl_publish")
    return {
        "peak_rss_gb_sft": peak("after", ("sft",)),
        "peak_rss_gb_rl": peak("after", rl),
        "peak_rss_gb_sft_before": peak("before", ("sft",)),
        "peak_rss_gb_rl_before": peak("before", rl),
        "peak_rss_gb": jobs["after"]["process_peak_gb"],
        "peak_rss_gb_before": jobs["before"]["process_peak_gb"],
        "peak_rss_ratio": round(jobs["after"]["process_peak_gb"] / jobs["before"]["process_peak_gb"], 3),
        "logits_bytes_per_microbatch": jobs["after"]["logits_bytes_per_microbatch"],
        "logits_bytes_per_microbatch_before": jobs["before"]["logits_bytes_per_microbatch"],
        "phases": {v: {n: ph["peak_gb"] for n, ph in jobs[v]["phases"].items()} for v in jobs},
        "components_after": {n: ph["components_gb"] for n, ph in jobs["after"]["phases"].items()},
        "estimate_gb_after": jobs["after"]["estimate_gb"],
        "activation_checkpointing": jobs["after"]["activation_checkpointing"],
        "peak_rss_gb_sft_ckpt": peak("ckpt", ("sft",)),
        "peak_rss_gb_rl_ckpt": peak("ckpt", rl),
        "ckpt_time_ratio_sft": round(jobs["ckpt"]["phases"]["sft"]["seconds"]
                                     / jobs["after"]["phases"]["sft"]["seconds"], 3),
        "ckpt_time_ratio_rl_train": round(jobs["ckpt"]["phases"]["rl_train"]["seconds"]
                                          / jobs["after"]["phases"]["rl_train"]["seconds"], 3),
        "lora_1p7b_step_s": big["step_s"],
        "lora_1p7b_peak_rss_gb": big["peak_rss_gb"],
        "lora_1p7b": big,
        "job_peak_rss_gb": job["peak_rss_gb"] if job else None,
        "job_peak_rss_ratio": round(job["peak_rss_gb"] / JOB_PEAK_BEFORE_GB, 3) if job else None,
        "job": job,
        "quick": quick,
    }


def step_child(kind: str, overrides: list[str] | None = None, transcripts_n: int = 4) -> dict[str, Any]:
    """One training step of the job's model at the job's lengths, under the job's config with ``overrides``
    (``KEY=VALUE`` as ``--set`` takes them): ``sft``, a full fine-tuning step on ``transcripts_n`` random
    transcripts in one batch; ``rl``, a LoRA GRPO step on 8 episodes in two groups of 4 that share 30% of their
    tokens. The peak resident memory (VmHWM: absolute, and above the start) and the seconds. Run each in a
    fresh process: ``python -m arborl_bench.memory_bench step sft|rl [KEY=VALUE ...]`` (the figures of
    ``train.malloc_mmap_threshold_mb``, ``train.logits_chunk_tokens`` and activation checkpointing in
    docs/training-an-agent.md)."""
    from arborl.config import load_config
    from arborl.heap import set_mmap_threshold
    from arborl.models import load_model
    from arborl.run.assemble import make_trainer
    from arborl.train.sft import sft_epochs, sft_mode

    if kind not in ("sft", "rl"):
        raise SystemExit(f"unknown step {kind!r}: sft or rl")
    cfg = load_config(str(_config_path()), list(overrides or []))
    set_mmap_threshold(cfg.train.malloc_mmap_threshold_mb << 20)
    torch.manual_seed(0)
    loaded = load_model(cfg.model)
    rng = random.Random(0)
    length, vocab = cfg.engine.max_seq_len, loaded.vocab_size
    if kind == "sft":
        trainer = make_trainer(loaded.model, cfg.train.model_copy(update={"lora_rank": 0}),
                               temperature=cfg.rollout.temperature)
        samples = transcripts(rng, transcripts_n, length, vocab)
    else:
        trainer = make_trainer(loaded.model, cfg.train, temperature=cfg.rollout.temperature)
        samples = transcripts(rng, 2 * GROUP_SIZE, length, vocab, group=GROUP_SIZE, shared=int(length * SHARED_FRACTION))
    reset_peak()
    start, t0 = rss(), time.perf_counter()
    if kind == "sft":
        with sft_mode(trainer, cfg.train) as t:
            sft_epochs(t, samples, epochs=1, batch=transcripts_n)
    else:
        trainer.train_step(samples)
    return {"step": kind, "overrides": list(overrides or []), "seconds": round(time.perf_counter() - t0, 1),
            "peak_gb": round(peak_rss() / GB, 3), "peak_above_start_gb": round((peak_rss() - start) / GB, 3)}


def sft_step_child(threshold_mb: int, transcripts_n: int = 4) -> dict[str, Any]:
    """``step_child("sft")`` with glibc's mmap threshold at ``threshold_mb`` (0: glibc's dynamic one)."""
    out = step_child("sft", [f"train.malloc_mmap_threshold_mb={threshold_mb}"], transcripts_n)
    return {"threshold_mb": threshold_mb, "seconds": out["seconds"], "peak_above_start_gb": out["peak_above_start_gb"]}


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    torch.set_num_threads(os.cpu_count() or 1)
    if argv[0] == "job":
        out = job_child(argv[1], quick)
    elif argv[0] == "big":
        out = big_child(quick)
    elif argv[0] == "sft-step":
        out = sft_step_child(int(argv[1]))
    elif argv[0] == "step":
        out = step_child(argv[1], [a for a in argv[2:] if a != "--quick"])
    else:
        raise SystemExit(f"unknown part {argv[0]!r}: job before|after|ckpt, big, sft-step MB, or step sft|rl [KEY=VALUE ...]")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
