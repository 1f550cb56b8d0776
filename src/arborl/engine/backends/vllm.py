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
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from arborl.config import Config
from arborl.engine.backends.base import BackendError
from arborl.engine.backends.model_dir import ModelDirs, default_work_dir
from arborl.engine.backends.remote import Piece, RemoteEngine, Segment
from arborl.engine.backends.server import ServerProcess, free_port
from arborl.models import LoadedModel
from arborl.types import InvalidRequestError

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


class VLLMEngine(RemoteEngine):
    kind = "vllm"

    def __init__(self, cfg: Config, loaded: LoadedModel, *, index: int = 0, version: int = 0) -> None:
        v = cfg.engine.vllm
        ecfg = cfg.engine.model_copy(update={"engine_id": f"{cfg.engine.engine_id.rsplit('-', 1)[0]}-{index}"})
        super().__init__(ecfg, eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.vocab_size,
                         tokenizer=loaded.tokenizer, version=version,
                         logprobs_kind="sample" if v.logprobs_mode == "processed_logprobs" else "raw")
        self.cfg = cfg
        self.v = v
        self.python = vllm_python(v.python)
        root = Path(v.work_dir).expanduser() / ecfg.engine_id if v.work_dir else default_work_dir(f"arborl-vllm-{index}-")
        self.own_dir = not v.work_dir  # a temporary directory: removed at shutdown
        self.dirs = ModelDirs(root, loaded.model, version)
        self.port = v.port + index if v.port else free_port(v.host)
        self.seed = cfg.seed + index
        self.server = ServerProcess(
            "vllm", self.argv, env=self.env(), url=self.url, log_path=root / "server.log",
            startup_timeout_s=v.startup_timeout_s, max_restarts=v.max_restarts,
        )
        try:
            self.server.start()
        except BaseException:
            if self.own_dir:
                shutil.rmtree(root, ignore_errors=True)
            raise

    def shutdown(self) -> None:
        super().shutdown()
        if self.own_dir:
            shutil.rmtree(self.dirs.root, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"http://{self.v.host}:{self.port}"

    # -- the server -------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        return server_argv(self.cfg, python=self.python, model_dir=self.dirs.current, port=self.port, seed=self.seed)

    def env(self) -> dict[str, str]:
        return server_env(self.cfg, dict(os.environ))

    # -- requests ---------------------------------------------------------------------------------
    def body(self, seg: Segment) -> dict:
        return request_body(seg)

    async def stream_segment(self, client: httpx.AsyncClient, seg: Segment) -> AsyncIterator[Piece]:
        async with client.stream("POST", f"{self.url}/v1/completions", json=self.body(seg)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:2000]
                if r.status_code == 400:
                    raise InvalidRequestError(f"vLLM rejected the request: {text}")
                raise BackendError(f"vLLM answered {r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BackendError(f"vLLM failed the request: {chunk['error']}")
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    yield Piece([], [], None, int(details["cached_tokens"]))
                for ch in chunk.get("choices") or []:
                    ids = ch.get("token_ids") or []
                    lps = (ch.get("logprobs") or {}).get("token_logprobs") or []
                    if len(lps) != len(ids):
                        raise BackendError(f"vLLM sent {len(ids)} token ids with {len(lps)} log-probs")
                    yield Piece(list(ids), [float(x) for x in lps], ch.get("finish_reason"))

    # -- weights ----------------------------------------------------------------------------------
    async def prepare_weights(self, state, version: int) -> object:
        return await asyncio.to_thread(self.dirs.write, state, version)

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

    async def _post(self, client: httpx.AsyncClient, path: str, **kw) -> httpx.Response:
        try:
            r = await client.post(f"{self.url}{path}", timeout=600.0, **kw)
        except httpx.HTTPError as e:
            raise BackendError(f"vLLM {path} failed: {e!r}") from e
        if r.status_code != 200:
            raise BackendError(f"vLLM {path} answered {r.status_code}: {r.text[:1000]}")
        return r
