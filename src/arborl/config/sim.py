"""The rollout simulator (sim/, `arborl simulate`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from arborl.config.base import Section, comma_list


class SimConfig(Section):
    """`arborl simulate`: a workload and a cluster (cost model) to compare scheduling policies on.

    The defaults are a Seer-like workload on GPU-class instances (~70B dense model on 4 accelerators)."""

    policies: list[str] = Field(
        default_factory=lambda: ["sync/pinned", "sync/seer", "async_ratio/pinned", "windowed_fifo/pinned"],
        description="variants to compare, each consume/dispatch (names of scheduling.consume and scheduling.dispatch); "
        "the other scheduling knobs apply to all; on the command line a comma-separated list: "
        "--set sim.policies=sync/pinned,sync/seer",
    )
    prompts: int = Field(400, ge=1, description="groups per training batch (N, prompts)")
    group_size: int = Field(8, ge=1, description="episodes per group (G)")
    steps: int = Field(2, ge=1, description="training steps simulated (batches consumed)")
    instances: int = Field(32, ge=1, description="engine instances (each one model replica)")
    prompt_tokens: int = Field(1024, ge=1, description="prompt length of every episode (tokens)")
    length_median: float = Field(10000.0, gt=0, description="median generated length per turn, lognormal (tokens)")
    sigma_prompt: float = Field(1.0, ge=0, description="log-sd of the per-prompt length scale (spread between groups)")
    sigma_member: float = Field(0.35, ge=0, description="log-sd of member noise around its prompt's scale (spread inside a group)")
    max_tokens: int = Field(65536, ge=1, description="cap of generated tokens per request (tokens)")
    min_tokens: int = Field(16, ge=1, description="floor of generated tokens per request (tokens)")
    turns: int = Field(1, ge=1, description="most turns per episode; each member draws 1..turns uniformly (1 = single call)")
    obs_tokens: int = Field(0, ge=0, description="tokens an environment observation adds to the context per turn (tokens)")
    env_median_s: float = Field(0.0, ge=0, description="median environment latency after each turn, lognormal (seconds; 0 = none)")
    env_sigma: float = Field(1.0, ge=0, description="log-sd of the environment latency")
    mixed_fraction: float = Field(
        1.0, ge=0, le=1, description="share of groups whose rewards differ, drawn per group; the others are "
        "all-equal (all fail or all pass): with train.advantage.drop_zero_variance their tokens are not trained, and "
        "scheduling.consume=dynamic drops them and draws again (1 = every group has a learning signal)",
    )
    train_base_s: float = Field(120.0, ge=0, description="trainer time per step, fixed part (seconds)")
    train_per_ktoken_s: float = Field(0.005, ge=0, description="trainer time per 1000 trained tokens (seconds)")
    decode_base_s: float = Field(0.02, ge=0, description="decode step time, fixed part (seconds)")
    decode_per_seq_s: float = Field(5e-5, ge=0, description="decode step time per sequence in the batch (seconds)")
    decode_per_ctx_token_s: float = Field(
        2.4e-8, ge=0, description="decode step time per token of context summed over the batch, attention KV reads (seconds)"
    )
    prefill_base_s: float = Field(0.005, ge=0, description="prefill time, fixed part per admission (seconds)")
    prefill_per_token_s: float = Field(7e-5, ge=0, description="prefill time per prompt token (seconds)")
    prefill_per_token2_s: float = Field(
        0.0, ge=0, description="prefill time per squared prompt token, attention's quadratic part (seconds; 0: linear)"
    )
    transfer_per_token_s: float = Field(
        2e-6, ge=0, description="KV transfer time per token when scheduling.migration=transfer (seconds)"
    )
    kv_capacity_tokens: int = Field(
        540_000, ge=1, description="KV memory of one instance; beyond it the newest sequence is preempted (tokens)"
    )
    max_batch: int = Field(256, ge=1, description="most sequences one instance decodes together")
    weight_update_s: float = Field(20.0, ge=0, description="pause of every instance to load new weights (seconds)")
    spec_acceptance: float = Field(
        0.0, ge=0, lt=1, description="speculative decoding: acceptance per draft position, e.g. as measured by "
        "`arborl bench specdec` with group drafts (0 = no speculation)"
    )
    spec_max_k: int = Field(4, ge=1, description="speculative decoding: most draft tokens per sequence and step (tokens)")
    seed: int = Field(0, description="seed of the workload's lengths and latencies")
    gantt_dir: str | None = Field(None, description="write one Gantt PNG per policy into this directory (None = none)")

    @field_validator("policies", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return comma_list(value)  # --set sim.policies=a/b,c/d
