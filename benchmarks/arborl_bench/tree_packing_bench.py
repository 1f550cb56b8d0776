"""``arborl bench tree-packing``: prefix-tree vs flat packing, SmolLM2-135M-Instruct forward +
backward on CPU.

Workloads (each micro-batch is one ``pack`` call: one GRPO group, or one question's episodes):

* ``80``: GRPO groups of 8, prompt/response lengths with shared fraction
  1 - tree_tokens / flat_tokens = 0.80 (token ratio 5x);
* ``35``: the same at 0.35 (token ratio 1.54x);
* ``multiturn``: a calculator agent: system prompt + user question, assistant tool call, tool
  result, second tool call, tool result, answer; one sample per assistant turn, each extending
  the previous one token for token; 4 episodes per question (a GRPO group), all sharing the
  system prompt;
* ``low``: little sharing (about 5%): ``mode="auto"`` must choose flat, so it is never slower.

Every workload runs flat and auto (tree where it pays) alternately, A B B A, in one process;
speedups are the median of the per-pair ratios (the machine is shared and noisy). The same loss
(a GRPO policy-gradient loss on response tokens, per-sample advantages) is backpropagated
through both, and ``grad_max_rel_diff`` is the largest max|g_tree - g_flat| / max|g_flat|
over all parameters and workloads (float32).

``shared_*`` is the tree's shared fraction 1 - tree_tokens / flat_tokens (the issue's definition),
``tokens_ratio_*`` = flat tokens / tokens the auto mode computed (repeated ancestor paths of split
rows included), ``speedup_*`` = flat time / auto time. On a shared 2-core box run it as
``OMP_NUM_THREADS=1 arborl bench tree-packing --quick``: two threads competing with another
process's threads stall in OpenMP barriers and make single timings swing by 5x.

Activation checkpointing (``train.activation_checkpointing``): forward + backward of the ``35``
workload (auto packing) without and with it. ``ckpt_peak_mib_off`` / ``_on``: the peak of the memory
torch allocated during the step above what it held before, from the allocations and frees its profiler
records (the gradients included, the same in both); ``ckpt_saved_mib`` their difference;
``ckpt_time_ratio`` on / off seconds (A B B A, unprofiled: the recomputation's cost);
``ckpt_grad_max_rel_diff`` the largest gradient difference (0: the same gradients).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from arborl.config import ModelConfig
from arborl.models import chat_token_ids, load_model
from arborl.train.packing import pack, packed_logprobs

GROUP = 8


@dataclass
class Workload:
    name: str
    batches: list[list[list[int]]]  # micro-batches of samples
    masks: list[list[list[int]]]  # per sample: 1 on tokens whose prediction carries loss (len - 1)


def grpo_workload(rng: random.Random, vocab: int, groups: int, prompt: int, response: int) -> Workload:
    """Random-token groups; responses differ from their first token, prompts between groups too,
    so the shared fraction is exactly 1 - (P + 8R) / (8 (P + R))."""
    batches, masks = [], []
    for g in range(groups):
        p = [1000 + g] + [rng.randrange(2000, vocab) for _ in range(prompt - 1)]
        group = [p + [1100 + i] + [rng.randrange(2000, vocab) for _ in range(response - 1)] for i in range(GROUP)]
        batches.append(group)
        masks.append([[0] * (prompt - 1) + [1] * response for _ in group])
    return Workload("", batches, masks)


SYSTEM = (
    "You are a careful assistant that solves arithmetic word problems with a calculator tool. "
    "To compute, write <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"...\"}}</tool_call> "
    "and wait for the result. Use one call per expression, with explicit parentheses. Never invent tool "
    "results and never repeat a call whose result you already have. When every quantity is known, "
    "finish with 'Answer: <number>' on its own line. Keep explanations to one sentence per step."
)
OPENERS = ["First I multiply.", "Let me start with the product.", "Step one: the multiplication.", "I need the product first."]
CLOSERS = ["Now I add the rest.", "Next, the addition.", "Then I add the remaining amount.", "Finally the sum."]


def _multiturn(tokenizer, rng: random.Random, questions: int, episodes: int) -> Workload:
    batches, masks = [], []
    for qi in range(questions):
        a, b, c = rng.randrange(3, 40), rng.randrange(3, 40), rng.randrange(10, 500)
        user = f"A shop sells {a} boxes with {b} pencils each and {c} single pencils. How many pencils does it sell in total?"
        group, group_masks = [], []
        for e in range(episodes):
            calls = [f"{a}*{b}", f"{a * b}+{c}"] if e % 2 == 0 else [f"({b})*({a})", f"{c}+{a * b}"]
            msgs = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": user},
                {"role": "assistant", "content": f"{OPENERS[e % 4]} <tool_call>{{\"name\": \"calculator\", \"arguments\": {{\"expression\": \"{calls[0]}\"}}}}</tool_call>"},
                {"role": "tool", "content": str(a * b)},
                {"role": "assistant", "content": f"{CLOSERS[e % 4]} <tool_call>{{\"name\": \"calculator\", \"arguments\": {{\"expression\": \"{calls[1]}\"}}}}</tool_call>"},
                {"role": "tool", "content": str(a * b + c)},
                {"role": "assistant", "content": f"The shop sells {a * b + c} pencils.\nAnswer: {a * b + c}"},
            ]
            prev: list[int] = []
            for turn in (3, 5, 7):  # one sample per assistant turn, each extending the previous
                prompt = chat_token_ids(tokenizer, msgs[: turn - 1], add_generation_prompt=True)
                full = chat_token_ids(tokenizer, msgs[:turn], add_generation_prompt=False)
                if full[: len(prompt)] != prompt or full[: len(prev)] != prev:
                    raise RuntimeError("chat template is not prefix-consistent across turns")
                # loss on every assistant turn's tokens so far (earlier turns sit in the shared prefix)
                mask = [0] * len(full)
                for t in range(3, turn + 1, 2):
                    p_t = chat_token_ids(tokenizer, msgs[: t - 1], add_generation_prompt=True)
                    f_t = chat_token_ids(tokenizer, msgs[:t], add_generation_prompt=False)
                    mask[len(p_t) : len(f_t)] = [1] * (len(f_t) - len(p_t))
                group.append(full)
                group_masks.append(mask[1:])
                prev = full
        batches.append(group)
        masks.append(group_masks)
    return Workload("multiturn", batches, masks)


def _step(model, work: Workload, mode: str, advantages: list[list[float]], checkpoint: bool = False) -> tuple[float, dict]:
    """Forward + backward over all micro-batches; returns seconds and token figures."""
    model.zero_grad(set_to_none=True)
    figures = {"tokens_flat": 0, "tokens_packed": 0, "modes": set(), "pack_s": 0.0}
    t0 = time.perf_counter()
    for samples, masks, advs in zip(work.batches, work.masks, advantages):
        tp = time.perf_counter()
        batch = pack(samples, mode=mode)  # type: ignore[arg-type]
        figures["pack_s"] += time.perf_counter() - tp
        logps = packed_logprobs(model, batch, checkpoint=checkpoint)
        loss = logps[0].new_zeros(())
        for lp, m, adv in zip(logps, masks, advs):
            mt = torch.tensor(m, dtype=lp.dtype)
            loss = loss - adv * (lp * mt).sum() / mt.sum().clamp(min=1)
        (loss / len(samples)).backward()
        figures["tokens_flat"] += batch.tokens_flat
        figures["tokens_packed"] += batch.tokens_packed
        figures["modes"].add(batch.mode)
    return time.perf_counter() - t0, figures


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        scale = float(y.abs().max())
        if scale > 0:
            worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


def _peak_mib(model, work: Workload, advantages: list[list[float]], checkpoint: bool) -> float:
    """Peak of the memory torch allocated during one forward + backward (auto packing) above what was
    allocated before it, MiB: the running sum of the allocations and frees torch's profiler records."""
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, work, "auto", advantages, checkpoint=checkpoint)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak / 2**20


def activation_checkpointing(model, work: Workload, advantages: list[list[float]], console: Console) -> dict:
    """The memory activation checkpointing saves on ``work`` and what it costs (module docstring)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    grads: dict[bool, list[torch.Tensor]] = {}
    for on in (False, True, True, False):  # A B B A, unprofiled: the time ratio
        secs, _ = _step(model, work, "auto", advantages, checkpoint=on)
        grads.setdefault(on, _grads(model))
        times[on].append(secs)
        console.print(f"  checkpointing {'on ' if on else 'off'} {secs:7.2f} s")
    off, on = _peak_mib(model, work, advantages, False), _peak_mib(model, work, advantages, True)
    model.zero_grad(set_to_none=True)
    return {"ckpt_peak_mib_off": off, "ckpt_peak_mib_on": on, "ckpt_saved_mib": off - on,
            "ckpt_time_ratio": statistics.median(times[True]) / statistics.median(times[False]),
            "ckpt_grad_max_rel_diff": _max_rel_diff(grads[True], grads[False])}


def run(quick: bool, console: Console) -> dict:
    loaded = load_model(ModelConfig(source="smollm2"))
    model, tok = loaded.model, loaded.tokenizer
    vocab = loaded.vocab_size
    rng = random.Random(0)
    reps = 2 if quick else 3
    # (P, R) with 1 - (P + 8R) / (8(P + R)) = 0.80 (P = 32R/3) and 0.35 (R = 1.5P)
    if quick:
        loads = {"80": grpo_workload(rng, vocab, 1, 192, 18), "35": grpo_workload(rng, vocab, 1, 48, 72)}
        loads["multiturn"] = _multiturn(tok, rng, 1, 4)
        loads["low"] = grpo_workload(rng, vocab, 1, 4, 60)
    else:
        loads = {"80": grpo_workload(rng, vocab, 2, 512, 48), "35": grpo_workload(rng, vocab, 2, 128, 192)}
        loads["multiturn"] = _multiturn(tok, rng, 4, 4)
        loads["low"] = grpo_workload(rng, vocab, 1, 8, 120)
    arng = random.Random(1)
    advantages = {k: [[arng.gauss(0, 1) for _ in b] for b in w.batches] for k, w in loads.items()}

    console.print(f"[bold]tree-packing[/bold]: {loaded.name}, CPU, torch threads={torch.get_num_threads()}, reps={reps} (A B B A)")
    _step(model, grpo_workload(rng, vocab, 1, 32, 8), "flat", [[1.0] * GROUP])  # warm-up

    results: dict[str, dict] = {}
    grad_diff = 0.0
    for name, work in loads.items():
        times: dict[str, list[float]] = {"flat": [], "auto": []}
        figs: dict[str, dict] = {}
        for rep in range(reps if name != "low" else 2 * reps):
            for mode in ("flat", "auto") if rep % 2 == 0 else ("auto", "flat"):  # A B B A: no order bias
                secs, f = _step(model, work, mode, advantages[name])
                times[mode].append(secs)
                figs[mode] = f
                if rep == 0:
                    if mode == "flat":
                        flat_grads = _grads(model)
                    else:
                        grad_diff = max(grad_diff, _max_rel_diff(_grads(model), flat_grads))
                        del flat_grads
                console.print(f"  {name:9s} rep {rep} {mode:4s} {secs:7.2f} s  ({f['tokens_packed']} tokens)")
        model.zero_grad(set_to_none=True)
        ratios = [a / b for a, b in zip(times["flat"], times["auto"])]
        tree_tokens = sum(pack(b, mode="tree").tokens_tree for b in work.batches)
        results[name] = {
            "tokens_flat": figs["flat"]["tokens_flat"],
            "tokens_packed": figs["auto"]["tokens_packed"],
            "tokens_ratio": figs["flat"]["tokens_flat"] / figs["auto"]["tokens_packed"],
            "shared": 1 - tree_tokens / figs["flat"]["tokens_flat"],
            "pack_ms": 1e3 * figs["auto"]["pack_s"],
            "mode": "+".join(sorted(figs["auto"]["modes"])),
            "flat_s": statistics.median(times["flat"]),
            "tree_s": statistics.median(times["auto"]),
            "speedup": statistics.median(ratios),
        }

    table = Table(title="tree packing vs flat packing (forward + backward, SmolLM2-135M, CPU)")
    for col in ("workload", "shared", "auto mode", "flat tokens", "packed tokens", "token ratio", "flat s", "auto s", "pack ms", "speedup"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(
            name, f"{r['shared']:.2f}", r["mode"], str(r["tokens_flat"]), str(r["tokens_packed"]),
            f"{r['tokens_ratio']:.2f}x", f"{r['flat_s']:.2f}", f"{r['tree_s']:.2f}", f"{r['pack_ms']:.1f}",
            f"{r['speedup']:.2f}x",
        )
    console.print(table)
    console.print(f"max relative gradient difference tree vs flat (float32): {grad_diff:.2e}")
    console.print("[bold]activation checkpointing[/bold] (workload 35, auto packing, forward + backward)")
    ckpt = activation_checkpointing(model, loads["35"], advantages["35"], console)
    console.print(f"peak memory of the step {ckpt['ckpt_peak_mib_off']:.0f} MiB off, {ckpt['ckpt_peak_mib_on']:.0f} MiB "
                  f"on: {ckpt['ckpt_saved_mib']:.0f} MiB saved, for {ckpt['ckpt_time_ratio']:.2f}x the time; "
                  f"gradient difference {ckpt['ckpt_grad_max_rel_diff']:.1e}")

    out: dict = {"benchmark": "tree-packing", "quick": quick, "model": loaded.name, "reps": reps,
                 "threads": torch.get_num_threads(), "grad_max_rel_diff": grad_diff}
    for name, r in results.items():
        out[f"tokens_ratio_{name}"] = round(r["tokens_ratio"], 4)
        out[f"shared_{name}"] = round(r["shared"], 4)
        out[f"speedup_{name}"] = round(r["speedup"], 3)
        out[f"flat_s_{name}"] = round(r["flat_s"], 3)
        out[f"tree_s_{name}"] = round(r["tree_s"], 3)
        out[f"auto_mode_{name}"] = r["mode"]
        out[f"pack_ms_{name}"] = round(r["pack_ms"], 2)
    out.update({k: round(v, 4) for k, v in ckpt.items()})
    return out
