"""Policy optimisation (train/, rewards/): reward shaping, advantages, the loss, corrections, MTP,
parallelism, rejection sampling, SFT and the trainer's own knobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from arborl.config.base import Section


class RewardShapingConfig(Section):
    """How an episode's reward parts combine before the advantage (rewards/shaping.py; Forge's composite
    reward): r = process_weight * process + speed_weight * speed + outcome_weight * outcome."""

    process_weight: float = Field(
        1.0, ge=0, description="w_p: weight of the per-turn process rewards (C1) the task or agent reported "
        "(0 = outcome only; reward units per reward unit)"
    )
    speed_weight: float = Field(
        0.0, ge=0, description="w_t: weight of the completion-time reward (C2), finishing faster than the group "
        "(0 = off; reward units per speed unit)"
    )
    outcome_weight: float = Field(1.0, ge=0, description="w_o: weight of the task's outcome reward (reward units)")
    component_weights: dict[str, float] = Field(
        default_factory=dict,
        description="the task's other reward components added to its outcome R, each times its weight: e.g. "
        "{tests_passed_frac: 0.5} gives code_repair partial credit for the hidden tests an episode passes (an episode "
        "passing 3 of 4 scores above one that breaks the repository). A component the task does not report counts 0; "
        "success (outcome >= 1) is unchanged. {} = the outcome alone",
    )
    speed_metric: Literal["wall_time", "turns", "tokens"] = Field(
        "tokens", description="what completion time counts for the speed reward: the episode's wall seconds, its "
        "model calls, or its generated tokens"
    )
    speed_success_only: bool = Field(
        True, description="only successful episodes (outcome >= 1) get a speed reward, compared among themselves "
        "(so failing fast is never rewarded)"
    )


class AdvantageConfig(Section):
    """Advantage estimation from rewards (rewards/estimators.py): GRPO, Dr.GRPO, RLOO, REINFORCE++,
    reward-to-go (C3), process rewards on their turns (C1)."""

    estimator: str = Field(
        "auto",
        description="advantage estimator (registry rewards.ADVANTAGE_ESTIMATORS): grpo = outcome reward minus the "
        "group mean, one value per sample, plus each turn's group-normalised process reward on that turn; rloo = "
        "leave-one-out baseline (+ process as grpo); reinforce_pp / reinforce_pp_baseline = REINFORCE++ turn "
        "returns whitened over the batch, without / with the group-mean baseline; reward_to_go = per-turn returns "
        "(reward from the turn to the episode's end) minus the group mean, one value per turn/chunk (C3, C4); "
        "auto = reward_to_go (its own gamma, 0.9) when the batch has process rewards, else grpo (the default since "
        "process rewards exist; was grpo); or a path to your own, package.module:attr or path/to/file.py:attr",
    )
    std_normalize: bool = Field(
        True,
        description="divide by the group's reward std (+ eps, the std given by `std`); false with "
        "train.loss.aggregation=constant is Dr.GRPO",
    )
    std: Literal["unbiased", "population"] = Field(
        "unbiased",
        description="the group std of std_normalize: unbiased = sample std, divide by G-1 (verl / TRL; the default "
        "since issue 15, was population); population = divide by G",
    )
    eps: float = Field(1e-6, gt=0, description="added to the group std before dividing (reward units)")
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="the chosen estimator's own settings, e.g. {gamma: 0.9} for reward_to_go (--set "
        "train.advantage.settings.gamma=0.9); each estimator's are listed in the section below (a user's estimator: "
        "the fields of its `Settings` pydantic model). Checked against the estimator before the model loads; unset "
        "ones take the estimator's defaults",
    )
    shaping: RewardShapingConfig = Field(
        default_factory=RewardShapingConfig,
        description="reward composition before the advantage: process, completion-time and outcome weights (C1, C2)",
    )
    drop_zero_variance: bool = Field(
        True, description="drop groups whose rewards are all equal (no learning signal); they are counted"
    )
    zero_variance_tol: float = Field(
        0.0, ge=0, description="a group whose max - min reward is <= this counts as zero-variance (reward units)"
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, (kinds, name) in MOVED_ADVANTAGE_KEYS.items():
                if key in data:
                    raise ValueError(
                        f"{key} moved: set train.advantage.settings.{name} (a setting of train.advantage.estimator "
                        f"{kinds}; each estimator has its own settings now, docs/knobs.md)"
                    )
        return data


# the flat advantage keys of before train.advantage.settings: old key -> (the estimators it belonged to, its name there)
MOVED_ADVANTAGE_KEYS: dict[str, tuple[str, str]] = {
    "gamma": ("reward_to_go, reinforce_pp, reinforce_pp_baseline, chunk_returns", "gamma"),
    "auto_gamma": ("auto", "gamma"),
}


# the flat loss keys of before train.loss.settings: old key -> (the kinds it belonged to, its name there)
MOVED_LOSS_KEYS: dict[str, tuple[str, str]] = {
    "clip_low": ("ppo, clip_cov", "clip_low"), "clip_high": ("ppo, clip_cov", "clip_high"), "dual_clip": ("ppo", "dual_clip"),
    "cispo_eps_high": ("cispo", "eps_high"), "cispo_eps_low": ("cispo", "eps_low"),
    "gspo_clip_low": ("gspo", "clip_low"), "gspo_clip_high": ("gspo", "clip_high"),
    "gmpo_clip_low": ("gmpo", "clip_low"), "gmpo_clip_high": ("gmpo", "clip_high"),
    "sapo_tau_pos": ("sapo", "tau_pos"), "sapo_tau_neg": ("sapo", "tau_neg"),
    "cov_clip_frac": ("clip_cov", "frac"), "cov_clip_lb": ("clip_cov", "lb"), "cov_clip_ub": ("clip_cov", "ub"),
    "kl_cov_frac": ("kl_cov", "frac"), "kl_cov_coef": ("kl_cov", "coef"),
    "ipa_clip_low": ("ipa", "clip_low"), "ipa_clip_high": ("ipa", "clip_high"),
    "ipa_mask_threshold": ("ipa", "mask_threshold"), "ipa_mask_sides": ("ipa", "mask_sides"),
}


class LossConfig(Section):
    """The policy-gradient loss (train/losses.py): the kind, its own settings, and the terms every kind shares."""

    kind: str = Field(
        "ppo",
        description="policy-gradient token loss (registry train.policy_losses.POLICY_LOSSES): ppo = token-level "
        "PPO-clip; cispo = MiniMax-M1's clipped IS weight (stop-gradient) x advantage x log-prob; gspo = "
        "sequence-level ratio (geometric mean per sample), clipped; gmpo = geometric mean of the token ratios clipped "
        "in log space; sapo = sigmoid soft gate instead of the clip; clip_cov / kl_cov = PPO / plain PG with the few "
        "highest log-prob x advantage covariance tokens detached / KL-penalised (Cui et al. 2025); ipa = ROLL's "
        "chunk-level ratio with a chunk mismatch mask (C4); sft = negative log-likelihood; or a path to your own, "
        "package.module:attr or path/to/file.py:attr. Every clip/gate acts only where the ratio differs from 1: with "
        "one optimiser step per batch and train.old_logprobs=trainer (the defaults) the ratio is 1 and every kind "
        "gives the PPO gradient, except clip_cov (its selected tokens are detached anyway) and ipa (its mismatch mask "
        "compares with the rollout)",
    )
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="the chosen kind's own settings, e.g. {clip_low: 0.1, clip_high: 0.3} for ppo or --set "
        "train.loss.settings.eps_high=0.2 for cispo; each kind's are listed in the section below (a user's loss: the "
        "fields of its `Settings` pydantic model). Checked against the kind with the other extension knobs, before "
        "the model loads; unset ones take the kind's defaults",
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the reference policy (0 = off, no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token estimator of KL(policy || reference): k1 = -log r, k2 = (log r)^2/2, k3 = r - 1 - "
        "log r (only with kl_coef > 0)"
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

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key in MOVED_LOSS_KEYS:
                    kinds, name = MOVED_LOSS_KEYS[key]
                    raise ValueError(
                        f"{key} moved: set train.loss.settings.{name} (a setting of train.loss.kind {kinds}; each kind "
                        "has its own settings now, docs/knobs.md)"
                    )
        return data


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
        "mean per sample); chunk (geometric mean per span between env interactions, C4); with mode=none it "
        "changes no weight (the metrics are per token)",
    )
    tis_cap: float = Field(
        2.0, gt=0, description="TIS truncation C of the ratio pi_train / pi_rollout (ratio units; only mode=tis)"
    )
    mask_low: float = Field(
        0.5, ge=0, description="MIS/IcePop: ratios below this get weight 0 (ratio units; only mode=mis or icepop)"
    )
    mask_high: float = Field(
        5.0, gt=0, description="MIS/IcePop: ratios above this get weight 0 (ratio units; only mode=mis or icepop)"
    )
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


class MTPTrainConfig(Section):
    """Online training of the mtp drafter's head (engine.spec.drafter=mtp), published with the policy weights.

    After each policy step, on the step's rollout tokens, the policy's hidden states detached."""

    enabled: bool = Field(False, description="train the MTP head every step and publish it with the policy weights")
    loss: Literal["topk_kl", "hard_ce"] = Field(
        "topk_kl",
        description="topk_kl: KL(policy || head) over the policy's top_k next tokens, renormalised (Forge); "
        "hard_ce: cross-entropy on the sampled next token (slime)",
    )
    top_k: int = Field(20, ge=1, description="topk_kl: tokens of the policy's next-token distribution kept (K)")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the head (its own optimiser)")
    iters: int = Field(1, ge=1, description="optimiser steps per RL step, each over all of the step's samples")
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm of the head (0 = no clipping)")
    save_path: str | None = Field(
        None, description="file the head is written to after each step (load it with engine.spec.mtp_path)"
    )


class ParallelConfig(Section):
    """Data-parallel training over several ranks under torch.distributed (train/parallel.py, docs/cluster.md)."""

    ranks: int = Field(
        1, ge=1, description="trainer ranks (processes, one device each); > 1 needs strategy ddp or fsdp2"
    )
    strategy: Literal["none", "ddp", "fsdp2"] = Field(
        "none",
        description="none = one process; ddp = every rank holds the whole model, gradients all-reduced; fsdp2 = "
        "parameters, gradients and optimiser state sharded across the ranks (torch fully_shard, one unit per "
        "decoder layer + the root)",
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp2: free a layer's gathered parameters after its forward (gather again in backward; "
        "less memory, more communication)"
    )
    mixed_precision: Literal["none", "bfloat16", "float16"] = Field(
        "none", description="fsdp2: dtype the gathered parameters compute in (gradients reduced in float32; none = "
        "the model's dtype)"
    )
    cpu_offload: bool = Field(
        False, description="fsdp2: keep the sharded parameters, gradients and optimiser state in CPU memory (CUDA runs)"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on CUDA, gloo on CPU"
    )
    threads_per_rank: int = Field(1, ge=1, description="torch CPU threads of each rank process")
    weight_sync: Literal["gather", "stream"] = Field(
        "stream",
        description="how the weights for the engines leave the shards: gather = the whole model gathered on rank 0, "
        "then published; stream = one layer at a time gathered and sent (rank 0 holds about one layer)",
    )
    timeout_s: float = Field(
        600.0, gt=0, description="longest wait for a collective or for a rank's answer before the group is torn down (seconds)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "ParallelConfig":
        if self.ranks > 1 and self.strategy == "none":
            raise ValueError(f"train.parallel.ranks={self.ranks} needs train.parallel.strategy=ddp or fsdp2")
        return self


class RejectionConfig(Section):
    """Rejection-sampling fine-tuning / expert iteration (train.sft.rejection): sample k episodes per
    train-split task, keep those that pass (the task's outcome is 1, after the judge when it is on),
    fine-tune on them, repeat."""

    rounds: int = Field(0, ge=0, description="sample-filter-fine-tune rounds before RL (0 = off; rounds)")
    k: int = Field(4, ge=1, description="episodes sampled per task and round (episodes)")
    tasks: int = Field(16, ge=1, description="train-split tasks sampled per round (tasks)")
    temperature: float = Field(0.8, gt=0, description="sampling temperature of the episodes")
    base_url: str | None = Field(
        None, description="sample from this OpenAI-compatible endpoint (a stronger model, .../v1) instead of the "
        "current policy; its transcripts are rendered by the policy's chat template (None = the current policy)")
    model: str | None = Field(None, description="model name sent to base_url")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding base_url's API key")


class SFTConfig(Section):
    """Supervised fine-tuning on chat transcripts (`arborl sft`, and the warm-start stage of `arborl train`):
    OpenAI-style messages (+ tools) rendered by the gateway's chat template, loss on assistant tokens only."""

    files: list[str] = Field(
        default_factory=list,
        description="JSONL / Parquet files of transcripts, one {messages, tools} object per row; non-empty: "
        "`arborl train` fine-tunes on them before RL",
    )
    epochs: int = Field(1, ge=1, description="passes over the transcripts (epochs)")
    batch_transcripts: int = Field(8, ge=1, description="transcripts per optimiser step (transcripts)")
    lr: float | None = Field(None, gt=0, description="AdamW learning rate of the SFT steps (None = train.lr)")
    heldout_fraction: float = Field(
        0.1, ge=0, lt=1, description="transcripts kept out of training to measure held-out NLL per token (fraction)")
    rejection: RejectionConfig = Field(default_factory=RejectionConfig, description="rejection sampling / expert iteration")
    full_finetune: bool = Field(
        False, description="with train.lora_rank > 0 in `arborl train`: the warm start trains every weight and the "
        "LoRA adapters are added for RL after it, on the fine-tuned weights (a resumed run rebuilds them from its "
        "checkpoint-sft); False = the warm start trains the adapters too. No effect without LoRA or a warm start")


class TrainConfig(Section):
    """Policy optimisation: advantages, loss, mismatch correction."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="advantage estimation")
    loss: LossConfig = Field(default_factory=LossConfig, description="policy-gradient loss")
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig, description="training-inference mismatch correction")
    mtp: MTPTrainConfig = Field(default_factory=MTPTrainConfig, description="online training of the MTP drafter's head")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="supervised warm-start on transcripts (`arborl sft`)")
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
        description="pi_old of the loss ratio: trainer = the trainer's own log-probs at the start of the step, before "
        "any update (recomputed by an extra forward when the step takes several optimiser steps; mismatch handled by "
        "`correction`); rollout = the behaviour policy's recorded log-probs (the ratio also measures staleness and "
        "mismatch, so the clip acts from the first optimiser step)",
    )
    ppo_epochs: int = Field(
        1, ge=1, description="passes over each batch; each pass takes `minibatches` optimiser steps (1 = one pass)"
    )
    minibatches: int = Field(
        1, ge=1, description="optimiser steps per pass: the batch is split into this many parts, groups kept together "
        "(capped at the number of samples; 1 = the whole batch per step)",
    )
    decoupled: bool = Field(
        False,
        description="decoupled PPO (AReaL) for stale data: the ratio is taken against the proximal policy (the trainer's "
        "log-probs at the start of the step) and the token loss is multiplied by pi_prox / pi_behaviour (the recorded "
        "rollout log-probs), 0 above decoupled_weight_cap; needs old_logprobs=trainer. It multiplies with "
        "`correction`'s weight, which corrects the same gap again: keep correction.mode=none with it",
    )
    decoupled_weight_cap: float | None = Field(
        5.0, gt=0, description="decoupled PPO: tokens whose pi_prox / pi_behaviour exceeds this get weight 0, as AReaL's "
        "behav_imp_weight_cap (ratio units; None = no cap; only with decoupled=true)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="keep only each decoder layer's input for the backward and recompute the layer there "
        "(torch.utils.checkpoint per layer): activation memory of one layer instead of all, for about one more "
        "forward's compute per step; gradients unchanged",
    )
    activation_checkpointing_layers: int | None = Field(
        None, ge=0,
        description="with activation_checkpointing: only the first N decoder layers are checkpointed, the rest keep "
        "their activations for the backward -- between none and all, N layers' recompute for N layers' activations "
        "(SmolLM2's 30 layers: 0.86 MB a token without checkpointing, 74 KB with every layer); None = every layer. "
        "No effect without activation_checkpointing",
    )
    malloc_mmap_threshold_mb: int = Field(
        16, ge=0, le=32,
        description="glibc's mmap threshold for the job's process (MB, arborl/heap.py): blocks this large or larger "
        "are mmapped and return to the system when freed, and the threshold stops climbing after a large free, so "
        "the C heap fragments less (a full fine-tuning step of SmolLM2, 4 x 2048 tokens: about 0.7 GB less peak "
        "and 2% more time; at 8 MB and below the page faults cost 25-40% of the time); 0 = glibc's dynamic "
        "threshold. A no-op where the C library is not glibc",
    )
    release_heap_per_layer: bool = Field(
        True,
        description="CPU training: the C heap's free pages go back to the system after each decoder layer's forward and "
        "backward (glibc malloc_trim). A layer's transients come in many sizes and interleave with what "
        "the backward keeps, so without it the heap keeps every layer's freed transients: one LoRA micro-batch of "
        "4096 tokens of SmolLM2 (activation checkpointing on, forward and backward) peaked 4.53 GB above its start "
        "without it and 1.41 GB with it (full fine-tuning: 2.95 and 2.04 GB), times within this machine's noise. Values "
        "and gradients unchanged; a no-op on GPU and where the C library is not glibc",
    )
    logits_chunk_tokens: int = Field(
        1024, ge=0,
        description="the LM head's logits exist for at most this many positions at a time, in the forward and the "
        "backward (log-probs, entropy and loss computed chunk by chunk from the last hidden states; the chunk's logits "
        "are recomputed in the backward): logits memory of one chunk, chunk x vocabulary x 4 bytes, whatever the "
        "micro-batch; values and gradients unchanged. 0 = every position's logits at once (memory grows with "
        "micro_batch_tokens x vocabulary)",
    )
    memory_limit_gb: float | None = Field(
        None, ge=0,
        description="memory a training step may use (GB). Before each step the trainer estimates its need -- "
        "weights, gradients, AdamW state, activations per token (measured once by a probe forward) x the largest "
        "micro-batch's tokens, and the logits chunk -- and stops with an error naming the knob to lower instead of "
        "being OOM-killed. None = the device's memory (the GPU's, or the machine's / container's RAM) less what the "
        "process holds besides the trainer; 0 = no check. One-process trainer only (not train.parallel's ranks)",
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="data-parallel training over ranks")
    lora_rank: int = Field(0, ge=0, description="LoRA rank via peft (0 = full fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling = alpha / rank; only with lora_rank > 0)")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="module names LoRA adapts (only with lora_rank > 0)",
    )
    lora_sync: Literal["adapters", "merged"] = Field(
        "adapters",
        description="how a LoRA policy reaches the engines after each step. adapters: the base weights once (per "
        "trainer), then only the adapters (lora_A, lora_B: bytes in proportion to the rank), served by the engine on "
        "the base it holds, with no merged copy and no repacking of the base; merged: the adapters merged into full "
        "weights every step. adapters applies where every engine is arborl's in-process engine; other engines "
        "(vLLM, SGLang, Ray actors) get merged weights. No effect without lora_rank > 0",
    )

    @property
    def checkpoint_layers(self) -> bool | int:
        """The decoder forward's ``checkpoint``: False, True (every layer) or the number of first layers."""
        if not self.activation_checkpointing:
            return False
        return True if self.activation_checkpointing_layers is None else self.activation_checkpointing_layers

    @model_validator(mode="after")
    def _decoupled_needs_proximal(self) -> "TrainConfig":
        if self.decoupled and self.old_logprobs != "trainer":
            raise ValueError("decoupled PPO clips around the trainer's proximal policy: set train.old_logprobs=trainer")
        return self

    @model_validator(mode="after")
    def _sft_in_one_process(self) -> "TrainConfig":
        if self.parallel.ranks > 1 and (self.sft.files or self.sft.rejection.rounds):
            raise ValueError("train.sft's warm start runs in one process: run `arborl sft` first, or set "
                             "train.parallel.ranks=1 for a job with train.sft")
        return self
