"""Headline figures of each benchmark, and the arithmetic over repeats.

``HEADLINES`` names, per benchmark, the few figures worth quoting: a key path into the JSON object the
benchmark prints last, a short label, a unit, and the README "Measured figures" row it belongs to. The
keys are the ones each ``run()`` returns (bench/*_bench.py); ``arborl bench all`` keeps every repeat's
value of each, their median and their spread, (max - min) / median.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rich.table import Table


@dataclass(frozen=True)
class Figure:
    """One headline figure: where it is in a benchmark's JSON, and how to show it."""

    path: tuple[str, ...]  # key path in the benchmark's last-line JSON object
    label: str  # short, for the README cell
    unit: str  # "x" (a ratio), "ms", "s", "tok/s", "eps/s", "frac" (0-1), "count", "tokens", "GB"
    row: str  # the README "Measured figures" row it belongs to


def _f(path: str, label: str, unit: str, row: str) -> Figure:
    return Figure(tuple(path.split("/")), label, unit, row)


HEADLINES: dict[str, list[Figure]] = {
    "engine": [
        _f("builtin_vs_vllm_fixed", "vs vLLM fixed lengths", "x", "engine vs vLLM"),
        _f("builtin_vs_vllm_natural", "vs vLLM natural lengths", "x", "engine vs vLLM"),
        _f("builtin_vs_vllm_multiturn", "vs vLLM multi-turn", "x", "engine vs vLLM"),
        _f("engine_vs_hf_tokens_per_s_fixed_len", "vs transformers fixed", "x", "engine vs transformers"),
        _f("engine_vs_hf_tokens_per_s", "vs transformers natural", "x", "engine vs transformers"),
        _f("multiturn_speedup", "multi-turn reuse on / off", "x", "engine multi-turn"),
        _f("bf16_vs_fp32_tokens_per_s", "bf16 vs fp32 rollout tokens/s", "x", "engine bf16 rollout"),
        _f("decode_b32_fraction_of_limit", "batch-32 decode step, fraction of roofline limit", "frac", "engine roofline"),
    ],
    "gateway": [
        _f("overhead_p50_ms", "overhead p50", "ms", "gateway overhead"),
        _f("overhead_p99_ms", "overhead p99", "ms", "gateway overhead"),
        _f("calls_lost", "calls lost", "count", "gateway overhead"),
    ],
    "tree-packing": [
        _f("speedup_80", "80% shared", "x", "tree packing"),
        _f("speedup_35", "35% shared", "x", "tree packing"),
        _f("speedup_multiturn", "multi-turn", "x", "tree packing"),
    ],
    "scheduling": [
        _f("sim_seer_vs_sync_throughput", "sim Seer vs sync", "x", "scheduling, simulator"),
        _f("sim_seer_tail_reduction", "sim Seer tail cut", "frac", "scheduling, simulator"),
        _f("sim_async_vs_sync_throughput", "sim async vs sync (agentic)", "x", "scheduling, simulator"),
        _f("real_seer_vs_sync_throughput", "2 engines Seer vs sync", "x", "scheduling, real engines"),
        _f("real_async_vs_sync_throughput", "2 engines async vs sync", "x", "scheduling, real engines"),
        _f("real_gateway_seer_vs_pinned_throughput", "gateway Seer vs pinned", "x", "scheduling, real engines"),
    ],
    "vs-trl": [
        _f("ratio_step", "ratio_step", "x", "vs TRL"),
        _f("ratio_generate", "ratio_generate", "x", "vs TRL"),
        _f("ratio_train", "ratio_train", "x", "vs TRL"),
    ],
    "envs": [
        _f("sandbox_start_p50_ms", "sandbox start p50", "ms", "sandboxed environments"),
        _f("sandbox_start_p99_ms", "sandbox start p99", "ms", "sandboxed environments"),
        _f("sandbox_episodes_per_s", "episodes/s", "eps/s", "sandboxed environments"),
        _f("escapes", "escapes", "count", "sandboxed environments"),
        _f("code_repair_success_after_sft", "code repair held-out after SFT", "frac", "sandboxed environments"),
        _f("code_repair_success_after", "code repair held-out after RL", "frac", "sandboxed environments"),
    ],
    "backends": [
        _f("vllm_vs_builtin_tokens_per_s", "vLLM vs built-in tokens/s", "x", "vLLM vs the built-in engine"),
        _f("vllm_weight_update_s", "vLLM weight update", "s", "vLLM vs the built-in engine"),
    ],
    "specdec": [
        _f("tail_decode_speedup_by_batch/1", "tail batch 1", "x", "speculative decoding"),
        _f("tail_decode_speedup_by_batch/2", "tail batch 2", "x", "speculative decoding"),
        _f("tail_decode_speedup_by_batch/4", "tail batch 4", "x", "speculative decoding"),
        _f("tau_group_gain", "group tau gain", "tokens", "speculative decoding"),
        _f("batch32_ratio", "batch 32", "x", "speculative decoding"),
        _f("draft_checkpoint_speedup", "separate draft checkpoint", "x", "speculative decoding"),
    ],
    "credit": [
        _f("ppo_epochs_2_vs_1_sample_efficiency", "2 PPO epochs vs 1", "x", "credit assignment"),
        _f("success_grpo_outcome", "success GRPO outcome", "frac", "credit assignment"),
        _f("success_grpo_process", "success GRPO + process", "frac", "credit assignment"),
        _f("success_rtg", "success reward-to-go", "frac", "credit assignment"),
        _f("success_ipa", "success IPA", "frac", "credit assignment"),
        _f("bf16_rollout_tokens_per_s_ratio", "bf16 vs fp32 tokens/s", "x", "credit assignment"),
        _f("success_bf16_tis_minus_fp32", "success bf16+TIS − fp32 (paired by seed)", "frac", "credit assignment"),
        _f("int8_rollout_tokens_per_s_ratio", "int8 vs fp32 tokens/s", "x", "credit assignment"),
    ],
    "parallel": [
        _f("grad_max_rel_diff", "2 ranks vs 1: gradient max rel. diff", "frac", "sharded training"),
        _f("memory_per_rank_ratio", "fsdp2 memory per rank / 1 process", "x", "sharded training"),
        _f("step_time_ratio", "step time 2 ranks / 1 process", "x", "sharded training"),
        _f("sync_stream_peak_ratio", "streamed weight sync peak / gathered", "x", "sharded training"),
        _f("episodes_lost", "episodes lost to a killed rank", "count", "sharded training"),
    ],
    "memory": [
        _f("peak_rss_ratio", "code-repair job's peak memory, lean / today's", "x", "memory"),
        _f("peak_rss_gb_sft", "peak memory in SFT", "GB", "memory"),
        _f("peak_rss_gb_rl", "peak memory in RL", "GB", "memory"),
        _f("lora_1p7b_peak_rss_gb", "LoRA GRPO step of a 1.7B-shaped model, peak", "GB", "memory"),
        _f("lora_1p7b_step_s", "LoRA GRPO step of a 1.7B-shaped model, time", "s", "memory"),
    ],
    "progress": [
        _f("time_to_target_ratio", "code-repair RL: stack / baseline time to the baseline's final success", "x", "progress"),
        _f("step_time_ratio", "code-repair RL step time, stack / baseline", "x", "progress"),
        _f("rollout_tokens_per_s_ratio", "code-repair rollout tokens/s, stack / baseline", "x", "progress"),
        _f("spec_acceptance_length", "speculative acceptance length on the job's generations", "tokens", "progress"),
        _f("baseline_final_success_mean", "baseline's final held-out success", "frac", "progress"),
        _f("stack_final_success_mean", "stack's final held-out success", "frac", "progress"),
    ],
    "cluster": [
        _f("faults_injected", "faults injected", "count", "Ray"),
        _f("episodes_lost", "episodes lost", "count", "Ray"),
        _f("calls_lost", "calls lost", "count", "Ray"),
        _f("ray_vs_local_step_ratio", "step Ray / in-process", "x", "Ray"),
    ],
    "faults": [
        _f("kills", "SIGKILLs of an async run, each resumed", "count", "faults"),
        _f("prompts_skipped", "prompts skipped", "count", "faults"),
        _f("episodes_trained_twice", "committed episodes trained twice", "count", "faults"),
        _f("episodes_dropped", "committed episodes dropped", "count", "faults"),
        _f("fuzz_5xx", "fuzzed OpenAI bodies answered 5xx", "count", "faults"),
        _f("sandbox_start_failures_256", "start failures, 256 sandboxes at once", "count", "faults"),
        _f("sandbox_start_p99_ms_256", "sandbox start p99, 256 at once", "ms", "faults"),
        _f("node_loss_episodes_lost", "committed episodes lost with a node", "count", "faults"),
    ],
}


def figure_table(title: str, figures: dict[str, Any], keys: Iterable[str] | None = None) -> Table:
    """A benchmark's figures as a two-column table (``keys``: these, in this order; default every one)."""
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k in keys if keys is not None else figures:
        table.add_row(k, str(figures.get(k)))
    return table


def lookup(output: dict[str, Any], path: tuple[str, ...]) -> float | None:
    """The number at ``path`` in a benchmark's JSON; None when absent or not a number (a bool is not)."""
    node: Any = output
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return None
    return float(node)


def spread(values: list[float]) -> float | None:
    """(max - min) / |median|: 0 for one value or equal values; None when the median is 0 and they differ."""
    if not values:
        return None
    lo, hi, med = min(values), max(values), statistics.median(values)
    if hi == lo:
        return 0.0
    return None if med == 0 else (hi - lo) / abs(med)


def summarize(name: str, outputs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """label -> {key, values, median, spread, unit, row} of ``name``'s headline figures over the repeats'
    outputs (a figure absent from an output, e.g. the vLLM column without vLLM, adds no value)."""
    out: dict[str, dict[str, Any]] = {}
    for fig in HEADLINES.get(name, []):
        values = [v for v in (lookup(o, fig.path) for o in outputs) if v is not None]
        out[fig.label] = {
            "key": "/".join(fig.path),
            "values": values,
            "median": statistics.median(values) if values else None,
            "spread": spread(values),
            "unit": fig.unit,
            "row": fig.row,
        }
    return out


def caveats(name: str, output: dict[str, Any] | None) -> list[str]:
    """What a reader must know beside the figures: a skipped vLLM column, an invalid comparison."""
    if not output:
        return []
    notes = []
    vllm = output.get("vllm")
    if name == "engine" and isinstance(vllm, str) and vllm.startswith(("skipped", "failed")):
        notes.append(f"vLLM column {vllm}")
    if name == "backends" and "vllm_tokens_per_s" not in output:
        notes.append("vLLM not available here: the built-in engine only")
    if name == "vs-trl" and output.get("valid") is False:
        notes.append("the comparison's checks failed: do not quote the ratios")
    return notes
