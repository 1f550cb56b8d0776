"""``arborl bench backends``: the same GRPO rollout on every engine backend available here.

32 chat prompts x a group of 8 (``--quick``: 8 x 4), SmolLM2-135M-Instruct, temperature 0.7, each
episode one chat call through the gateway (recorded in the data pool like training). Per backend:
rollout seconds and generated tokens/s (backends alternate, median of the rounds), then for vLLM:
the weight-update seconds (new weights written and loaded, median of 3), the mismatch KL between
the rollout's log-probs and the trainer's recompute (the tempered distribution, as the trainer
compares), and token fidelity (the ids the client saw == the recorded call's == the trained sample's).
SGLang runs only on CUDA (scripts/gpu_check_backends.py).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from arborl.run.assemble import Assembled, build_gateway
from arborl_bench.engine_bench import QUESTIONS
from arborl.config import Config, load_config
from arborl.engine.backends import BackendError
from arborl.models import LoadedModel, load_model

TEMPERATURE = 0.7


def rollout_episodes(built: Assembled, *, prompts: int, group: int, max_tokens: int, seed: int) -> tuple[float, list[dict]]:
    """Every episode of the rollout at once; returns (seconds, [{response, trajectory}])."""

    async def one(i: int, g: int) -> dict:
        gw = built.gateway
        info = await gw.create_session(task_id=f"q{i}", group_id=f"g{i}")
        q = QUESTIONS[i % len(QUESTIONS)].format(a=17 + 13 * i, b=3 + 7 * i)
        body = {"messages": [{"role": "user", "content": q}], "temperature": TEMPERATURE, "max_tokens": max_tokens,
                "seed": seed * 100_000 + i * 100 + g, "return_token_ids": True}
        resp = await gw.chat_completion(info.session, body)
        await gw.finish(info.session)
        return {"response": resp, "trajectory": await gw.trajectory(info.session)}

    async def all_of_them() -> tuple[float, list[dict]]:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(i, g) for i in range(prompts) for g in range(group)))
        return time.perf_counter() - t0, list(out)

    return asyncio.run(all_of_them())


def token_fidelity(episodes: list[dict]) -> bool:
    for ep in episodes:
        seen = ep["response"]["choices"][0]["token_ids"]
        [call] = ep["trajectory"]["calls"]
        [sample] = ep["trajectory"]["samples"]
        trained = [t for t, m in zip(sample["token_ids"], sample["loss_mask"]) if m]
        if not (seen == call["completion_token_ids"] == trained):
            return False
    return True


@torch.no_grad()
def mismatch_kl(model: torch.nn.Module, episodes: list[dict]) -> float:
    """Mean k3 KL estimate (r - 1 - log r, r = pi_train / pi_rollout) over generated tokens, with the
    trainer's recompute under softmax(logits / T) against the rollout's sampling log-probs."""
    total, n = 0.0, 0
    for ep in episodes:
        [call] = ep["trajectory"]["calls"]
        prompt, comp = call["prompt_token_ids"], call["completion_token_ids"]
        if not comp:
            continue
        dev = next(model.parameters()).device
        ids = torch.tensor([prompt + comp], device=dev)
        logits = model(ids).logits[0].float() / TEMPERATURE
        pos = torch.arange(len(prompt) - 1, len(prompt) + len(comp) - 1, device=dev)
        train = torch.log_softmax(logits, -1)[pos, torch.tensor(comp, device=dev)]
        d = train - torch.tensor(call["sample_logprobs"], device=dev)
        total += float((torch.exp(d) - 1 - d).sum())
        n += len(comp)
    return total / max(n, 1)


def weight_update_seconds(built: Assembled, loaded: LoadedModel, times: int) -> list[float]:
    eng = built.engines.engines[0]
    state = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}

    async def go() -> list[float]:
        return [await eng.update_weights(state, eng.version + 1) for _ in range(times)]

    return asyncio.run(go())


def _config(backend: str) -> Config:
    return load_config(None, [f"engine.backend={backend}", "engine.max_batch_size=32", "engine.max_seq_len=1024",
                              "engine.vllm.kv_cache_gib=2"])


def run(quick: bool, console: Console) -> dict[str, Any]:
    prompts, group, max_tokens, rounds = (8, 4, 48, 1) if quick else (32, 8, 96, 2)
    cfg = _config("builtin")
    loaded = load_model(cfg.model)
    backends: dict[str, Assembled] = {}
    out: dict[str, Any] = {"prompts": prompts, "group": group, "max_tokens": max_tokens}
    with tempfile.TemporaryDirectory(prefix="arborl-bench-backends-") as tmp:
        backends["builtin"] = build_gateway(cfg, loaded=loaded, run_dir=f"{tmp}/builtin")
        t0 = time.perf_counter()
        try:
            backends["vllm"] = build_gateway(_config("vllm"), loaded=loaded, run_dir=f"{tmp}/vllm")
            out["vllm_startup_s"] = time.perf_counter() - t0
        except BackendError as e:
            console.print(f"vLLM is not available here ({str(e).splitlines()[0]}); only the built-in engine runs")
        try:
            runs: dict[str, list[tuple[float, int]]] = {name: [] for name in backends}
            last: dict[str, list[dict]] = {}
            for r in range(rounds):
                for name, built in backends.items():
                    secs, eps = rollout_episodes(built, prompts=prompts, group=group, max_tokens=max_tokens, seed=r)
                    toks = sum(len(ep["trajectory"]["calls"][0]["completion_token_ids"]) for ep in eps)
                    runs[name].append((secs, toks))
                    last[name] = eps
            table = Table(title=f"GRPO rollout: {prompts} prompts x {group}, <= {max_tokens} new tokens, T={TEMPERATURE}")
            for col in ("backend", "rollout s", "tokens", "tokens/s", "mismatch KL", "token fidelity"):
                table.add_column(col)
            for name, rs in runs.items():
                step_s = statistics.median(s for s, _ in rs)
                tps = statistics.median(t / s for s, t in rs)
                kl = mismatch_kl(loaded.model, last[name])
                fid = token_fidelity(last[name])
                out[f"{name}_step_s"], out[f"{name}_tokens_per_s"] = step_s, tps
                out[f"{name}_mismatch_kl"], out[f"{name}_token_fidelity"] = kl, fid
                table.add_row(name, f"{step_s:.2f}", str(rs[-1][1]), f"{tps:.1f}", f"{kl:.2e}", str(fid))
            console.print(table)
            if "vllm" in backends:
                ups = weight_update_seconds(backends["vllm"], loaded, 3)
                out["vllm_weight_update_s"] = statistics.median(ups)
                out["vllm_weight_load_s"] = statistics.median(backends["vllm"].engines.engines[0].weight_load_s)
                out["vllm_vs_builtin_tokens_per_s"] = out["vllm_tokens_per_s"] / out["builtin_tokens_per_s"]
                out["vllm_vs_builtin_step_s"] = out["vllm_step_s"] / out["builtin_step_s"]
                console.print(f"vLLM weight update (write + load + prefix-cache reset): {out['vllm_weight_update_s']:.2f} s "
                              f"(median of {len(ups)}: {', '.join(f'{u:.2f}' for u in ups)}); startup {out['vllm_startup_s']:.0f} s")
        finally:
            for built in backends.values():
                built.close()
    return out
