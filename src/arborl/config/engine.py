"""The built-in inference engine (engine/), its speculative decoding (engine/specdec/) and the served
backends vLLM and SGLang (engine/backends/)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from arborl.config.base import Section


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
