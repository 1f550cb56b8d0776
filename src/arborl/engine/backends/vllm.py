"""engine.backend=vllm: vLLM's OpenAI-compatible server as an arborl engine (docs/backends.md).

arborl writes the serving model to a work directory, starts ``python -m
vllm.entrypoints.openai.api_server`` on it (its own interpreter, ``engine.vllm.python``) and
supervises it. Requests go to ``/v1/completions`` as token ids (``prompt`` = ids,
``return_token_ids``, ``logprobs=0``: the sampled token's log-prob, ``return_tokens_as_token_ids``),
streamed; the server runs with ``--skip-tokenizer-init`` (nothing is re-tokenised or detokenised there)
and ``--generation-config vllm`` (no sampling defaults from the model's files). Weight updates: the
weights are written as the next version's directory, then ``/pause`` (nothing runs),
``/collective_rpc reload_weights`` from that directory, ``/reset_prefix_cache``, ``/resume``
(``VLLM_SERVER_DEV_MODE=1`` serves these endpoints). A restarted server starts from the newest
version.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from arborl.config import Config
from arborl.engine.backends.base import BackendError
from arborl.engine.backends.remote import Piece, Segment
from arborl.engine.backends.served import ServedEngine
from arborl.models import LoadedModel

SERVED_NAME = "arborl"
REPO_ROOT = Path(__file__).resolve().parents[4]


def resolve_python(python: str, what: str, hint: str) -> str:
    """The interpreter ``python`` names: a path (relative to the working directory, else to the
    repository), or a command on PATH."""
    p = Path(python).expanduser()
    if os.sep in python or p.suffix:
        for cand in (p, REPO_ROOT / p):
            if cand.is_file():
                return str(cand.absolute())
        raise BackendError(f"{what} is not installed at {python}: {hint}")
    return python


VLLM_VENV_PYTHON = ".venv-vllm/bin/python"


def vllm_python(setting: str) -> str:
    """engine.vllm.python resolved: ``auto`` is .venv-vllm's interpreter when there is one, else this one
    when it can import vLLM."""
    hint = "run `make vllm` (or pip install -e .[vllm], or set engine.vllm.python to an interpreter that has vLLM)"
    if setting != "auto":
        return resolve_python(setting, "vLLM", hint)
    try:
        return resolve_python(VLLM_VENV_PYTHON, "vLLM", hint)
    except BackendError:
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        raise BackendError(f"vLLM is not installed (no {VLLM_VENV_PYTHON}, and this Python has no vllm): {hint}") from None


def server_argv(cfg: Config, *, python: str, model_dir: Path, port: int, seed: int) -> list[str]:
    """The command line of vLLM's server for ``cfg`` (engine.vllm, engine.max_seq_len / max_batch_size, model.dtype)."""
    v, e = cfg.engine.vllm, cfg.engine
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME, "--host", v.host, "--port", str(port),
        "--dtype", cfg.model.dtype, "--max-model-len", str(e.max_seq_len), "--max-num-seqs", str(e.max_batch_size),
        "--seed", str(seed), "--skip-tokenizer-init", "--generation-config", "vllm",
        "--logprobs-mode", v.logprobs_mode, "--enable-prompt-tokens-details",
        "--enable-prefix-caching" if v.prefix_caching else "--no-enable-prefix-caching",
        "--uvicorn-log-level", "warning",
    ]
    if v.enforce_eager:
        args.append("--enforce-eager")
    if v.speculative_config:
        args += ["--speculative-config", json.dumps(v.speculative_config)]
    return args + list(v.extra_args)


def server_env(cfg: Config, base: dict[str, str]) -> dict[str, str]:
    """vLLM's environment: its dev endpoints on; on CPU its KV cache size and core binding; on CUDA the device."""
    v = cfg.engine.vllm
    env = dict(base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache, /pause, /resume
    env.pop("VIRTUAL_ENV", None)
    device = cfg.model.device
    if device.startswith("cuda"):
        if ":" in device:
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        return env
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{v.kv_cache_gib:g}"
    if v.cpu_threads_bind == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    elif v.cpu_threads_bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = v.cpu_threads_bind
    else:
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return env


def request_body(seg: Segment) -> dict:
    """The /v1/completions body of one segment: token ids in, token ids and the sampled tokens' log-probs
    out; arborl's EOS ids as stop token ids (the server's own EOS handling off)."""
    p = seg.params
    body = {
        "model": SERVED_NAME, "prompt": seg.tokens, "max_tokens": seg.max_tokens,
        "temperature": p.temperature, "top_p": p.top_p, "stream": True,
        "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "ignore_eos": True, "stop_token_ids": seg.stop_token_ids, "skip_special_tokens": False,
        "stream_options": {"include_usage": True},
    }
    if p.top_k > 0:
        body["top_k"] = p.top_k
    if seg.seed is not None:
        body["seed"] = seg.seed
    return body


class VLLMEngine(ServedEngine):
    kind = "vllm"
    label = "vLLM"

    def __init__(self, cfg: Config, loaded: LoadedModel, *, index: int = 0, version: int = 0) -> None:
        v = cfg.engine.vllm
        super().__init__(cfg, loaded, v, python=vllm_python(v.python), index=index, version=version,
                         logprobs_kind="sample" if v.logprobs_mode == "processed_logprobs" else "raw")

    def argv(self) -> list[str]:
        return server_argv(self.cfg, python=self.python, model_dir=self.dirs.current, port=self.port, seed=self.seed)

    def env(self) -> dict[str, str]:
        return server_env(self.cfg, dict(os.environ))

    def body(self, seg: Segment) -> dict:
        return request_body(seg)

    async def stream_segment(self, client: httpx.AsyncClient, seg: Segment) -> AsyncIterator[Piece]:
        async for chunk in self.sse(client, "/v1/completions", self.body(seg)):
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                yield Piece([], [], None, int(details["cached_tokens"]))
            for ch in chunk.get("choices") or []:
                ids = ch.get("token_ids") or []
                logprobs = (ch.get("logprobs") or {}).get("token_logprobs") or []
                if len(logprobs) != len(ids):
                    raise BackendError(f"vLLM sent {len(ids)} token ids with {len(logprobs)} log-probs")
                yield Piece(list(ids), [float(x) for x in logprobs], ch.get("finish_reason"))

    # -- weights ----------------------------------------------------------------------------------
    async def load_weights(self, client: httpx.AsyncClient, prepared: object, version: int) -> None:
        path = Path(str(prepared))
        await self._post(client, "/pause", params={"mode": "abort"})
        try:
            await self._post(client, "/collective_rpc", json={"method": "reload_weights",
                                                              "kwargs": {"weights_path": str(path)}})
            for _ in range(200):
                r = await self._post(client, "/reset_prefix_cache")
                if r.json().get("success"):
                    break
                await asyncio.sleep(0.02)
            else:
                raise BackendError("vLLM did not reset its prefix cache after a weight update")
        finally:
            await self._post(client, "/resume")
        self.dirs.commit(path)
