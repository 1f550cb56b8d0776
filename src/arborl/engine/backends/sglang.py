"""engine.backend=sglang: SGLang's server as an arborl engine, CUDA only (docs/backends.md).

Same shape as the vLLM backend (``remote.RemoteEngine``): the serving model is written to a work
directory, ``python -m sglang.launch_server`` runs on it with ``--skip-tokenizer-init``, supervised.
Requests go to ``/generate`` with ``input_ids``, ``return_logprob`` and ``stream``; a stream chunk's
``meta_info.completion_tokens`` says how many tokens exist so far, so the new ones are the tail of
``meta_info.output_token_logprobs`` (``[logprob, token id, text]``) whether the server streams
increments or the whole output. Weight updates: ``/update_weights_from_disk`` from the next version's
directory, then ``/flush_cache``. SGLang returns log-probs under the sampling distribution (after
temperature) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: the engine treats them as sample log-probs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from arborl.config import Config
from arborl.engine.backends.base import BackendError
from arborl.engine.backends.model_dir import ModelDirs, default_work_dir
from arborl.engine.backends.remote import Piece, RemoteEngine, Segment
from arborl.engine.backends.server import ServerProcess, free_port
from arborl.engine.backends.vllm import resolve_python
from arborl.models import LoadedModel
from arborl.types import InvalidRequestError


def server_argv(cfg: Config, *, python: str, model_dir: Path, port: int, seed: int) -> list[str]:
    """The command line of SGLang's server for ``cfg`` (engine.sglang, engine limits, model.dtype)."""
    s, e = cfg.engine.sglang, cfg.engine
    return [
        python, "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--host", s.host, "--port", str(port), "--dtype", cfg.model.dtype,
        "--context-length", str(e.max_seq_len), "--max-running-requests", str(e.max_batch_size),
        "--mem-fraction-static", str(s.mem_fraction_static), "--random-seed", str(seed),
        "--skip-tokenizer-init", *s.extra_args,
    ]


class SGLangEngine(RemoteEngine):
    kind = "sglang"

    def __init__(self, cfg: Config, loaded: LoadedModel, *, index: int = 0, version: int = 0) -> None:
        if not cfg.model.device.startswith("cuda"):
            raise BackendError("engine.backend=sglang needs a CUDA GPU (set model.device=cuda); on a CPU machine use "
                               "engine.backend=vllm or builtin")
        s = cfg.engine.sglang
        ecfg = cfg.engine.model_copy(update={"engine_id": f"{cfg.engine.engine_id.rsplit('-', 1)[0]}-{index}"})
        super().__init__(ecfg, eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.vocab_size,
                         tokenizer=loaded.tokenizer, version=version, logprobs_kind="sample")
        self.cfg = cfg
        self.s = s
        self.python = resolve_python(s.python, "SGLang", "pip install 'sglang[all]' into an interpreter and set "
                                     "engine.sglang.python to it")
        root = Path(s.work_dir).expanduser() / ecfg.engine_id if s.work_dir else default_work_dir(f"arborl-sglang-{index}-")
        self.own_dir = not s.work_dir  # a temporary directory: removed at shutdown
        self.dirs = ModelDirs(root, loaded.model, version)
        self.port = s.port + index if s.port else free_port(s.host)
        self.seed = cfg.seed + index
        self.server = ServerProcess(
            "sglang", self.argv, env=self.env(), url=self.url, log_path=root / "server.log",
            startup_timeout_s=s.startup_timeout_s, max_restarts=s.max_restarts,
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
        return f"http://{self.s.host}:{self.port}"

    def argv(self) -> list[str]:
        return server_argv(self.cfg, python=self.python, model_dir=self.dirs.current, port=self.port, seed=self.seed)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("VIRTUAL_ENV", None)
        device = self.cfg.model.device
        if ":" in device:
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        return env

    def body(self, seg: Segment) -> dict:
        p = seg.params
        sampling = {
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
            "max_new_tokens": seg.max_tokens, "stop_token_ids": seg.stop_token_ids, "ignore_eos": True,
            "no_stop_trim": True, "skip_special_tokens": False,
        }
        if seg.seed is not None:
            sampling["sampling_seed"] = seg.seed
        return {"input_ids": seg.tokens, "sampling_params": sampling, "stream": True, "return_logprob": True,
                "logprob_start_len": -1, "rid": seg.request_id}

    async def stream_segment(self, client: httpx.AsyncClient, seg: Segment) -> AsyncIterator[Piece]:
        taken = 0
        async with client.stream("POST", f"{self.url}/generate", json=self.body(seg)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:2000]
                if r.status_code == 400:
                    raise InvalidRequestError(f"SGLang rejected the request: {text}")
                raise BackendError(f"SGLang answered {r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BackendError(f"SGLang failed the request: {chunk['error']}")
                meta = chunk.get("meta_info") or {}
                entries = meta.get("output_token_logprobs") or []
                total = int(meta.get("completion_tokens", taken + len(entries)))
                new = entries[len(entries) - (total - taken):] if total > taken else []
                taken = total
                finish = meta.get("finish_reason")
                reason = finish.get("type") if isinstance(finish, dict) else finish
                cached = meta.get("cached_tokens")
                yield Piece([int(e[1]) for e in new], [float(e[0]) for e in new], reason,
                            int(cached) if cached is not None else None)

    async def prepare_weights(self, state, version: int) -> object:
        return await asyncio.to_thread(self.dirs.write, state, version)

    async def load_weights(self, client: httpx.AsyncClient, prepared: object, version: int) -> None:
        path = Path(str(prepared))
        r = await self._post(client, "/update_weights_from_disk", json={"model_path": str(path)})
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if body.get("success") is False:
            raise BackendError(f"SGLang could not load the weights from {path}: {body.get('message')}")
        await self._post(client, "/flush_cache")
        self.dirs.commit(path)

    async def _post(self, client: httpx.AsyncClient, path: str, **kw) -> httpx.Response:
        try:
            r = await client.post(f"{self.url}{path}", timeout=600.0, **kw)
        except httpx.HTTPError as e:
            raise BackendError(f"SGLang {path} failed: {e!r}") from e
        if r.status_code != 200:
            raise BackendError(f"SGLang {path} answered {r.status_code}: {r.text[:1000]}")
        return r
