"""engine.backend=sglang: SGLang's server as an arborl engine, CUDA only (docs/backends.md).

Same shape as the vLLM backend (``remote.ServerEngine``): the serving model is written to a work
directory, ``python -m sglang.launch_server`` runs on it with ``--skip-tokenizer-init``, supervised.
Requests go to ``/generate`` with ``input_ids``, ``return_logprob`` and ``stream``; a stream chunk's
``meta_info.completion_tokens`` says how many tokens exist so far, so the new ones are the tail of
``meta_info.output_token_logprobs`` (``[logprob, token id, text]``) whether the server streams
increments or the whole output. Weight updates: ``/update_weights_from_disk`` from the next version's
directory, then ``/flush_cache``. SGLang returns log-probs under the sampling distribution (after
temperature) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: the engine treats them as sample log-probs.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from arborl.config import Config
from arborl.engine.backends.base import BackendError
from arborl.engine.backends.remote import Piece, Segment
from arborl.engine.backends.served import ServedEngine
from arborl.engine.backends.vllm import resolve_python
from arborl.models import LoadedModel


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


class SGLangEngine(ServedEngine):
    kind = "sglang"
    label = "SGLang"

    def __init__(self, cfg: Config, loaded: LoadedModel, *, index: int = 0, version: int = 0) -> None:
        if not cfg.model.device.startswith("cuda"):
            raise BackendError("engine.backend=sglang needs a CUDA GPU (set model.device=cuda); on a CPU machine use "
                               "engine.backend=vllm or builtin")
        s = cfg.engine.sglang
        python = resolve_python(s.python, "SGLang", "pip install 'sglang[all]' into an interpreter and set "
                                "engine.sglang.python to it")
        super().__init__(cfg, loaded, s, python=python, index=index, version=version, logprobs_kind="sample")

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
        async for chunk in self.sse(client, "/generate", self.body(seg)):
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

    async def load_weights(self, client: httpx.AsyncClient, prepared: object, version: int) -> None:
        path = Path(str(prepared))
        r = await self._post(client, "/update_weights_from_disk", json={"model_path": str(path)})
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if body.get("success") is False:
            raise BackendError(f"SGLang could not load the weights from {path}: {body.get('message')}")
        await self._post(client, "/flush_cache")
        self.dirs.commit(path)
