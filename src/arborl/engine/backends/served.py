"""A remote engine whose server arborl starts and supervises on this machine (vLLM, SGLang): the
serving model written to a work directory (one subdirectory per weight version), the server on a
free port, restarted by ``ServerProcess``, and the work directory removed at shutdown when arborl
chose it."""

from __future__ import annotations

import asyncio
import json
import shutil
from abc import abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import httpx

from arborl.config import Config
from arborl.engine.backends.base import BackendError
from arborl.engine.backends.model_dir import ModelDirs, default_work_dir
from arborl.engine.backends.remote import ServerEngine
from arborl.engine.backends.server import ServerProcess, free_port
from arborl.models import LoadedModel
from arborl.types import InvalidRequestError


class ServerSettings(Protocol):
    """What ``engine.vllm`` and ``engine.sglang`` share."""

    host: str
    port: int
    work_dir: str | None
    startup_timeout_s: float
    max_restarts: int


class ServedEngine(ServerEngine):
    label = "server"  # the server's name in error messages

    def __init__(self, cfg: Config, loaded: LoadedModel, settings: ServerSettings, *, python: str, index: int,
                 version: int, logprobs_kind: str) -> None:
        ecfg = cfg.engine.model_copy(update={"engine_id": f"{cfg.engine.engine_id.rsplit('-', 1)[0]}-{index}"})
        super().__init__(ecfg, eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.vocab_size,
                         tokenizer=loaded.tokenizer, version=version, logprobs_kind=logprobs_kind)
        self.cfg = cfg
        self.settings = settings
        self.python = python
        root = (Path(settings.work_dir).expanduser() / ecfg.engine_id if settings.work_dir
                else default_work_dir(f"arborl-{self.kind}-{index}-"))
        self.own_dir = not settings.work_dir  # a temporary directory: removed at shutdown
        self.dirs = ModelDirs(root, loaded.model, version)
        self.port = settings.port + index if settings.port else free_port(settings.host)
        self.seed = cfg.seed + index
        self.server = ServerProcess(
            self.kind, self.argv, env=self.env(), url=self.url, log_path=root / "server.log",
            startup_timeout_s=settings.startup_timeout_s, max_restarts=settings.max_restarts,
        )
        try:
            self.server.start()
        except BaseException:
            if self.own_dir:
                shutil.rmtree(root, ignore_errors=True)
            raise

    @abstractmethod
    def argv(self) -> list[str]:
        """The server's command line, serving ``self.dirs.current`` (re-read at every restart)."""

    @abstractmethod
    def env(self) -> dict[str, str]:
        """The server's environment."""

    def shutdown(self) -> None:
        super().shutdown()
        if self.own_dir:
            shutil.rmtree(self.dirs.root, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    async def prepare_weights(self, state, version: int) -> object:
        return await asyncio.to_thread(self.dirs.write, state, version)

    async def raise_for_status(self, r: httpx.Response) -> None:
        """A generate response that is not 200: the request's fault (400) or the server's."""
        if r.status_code == 200:
            return
        text = (await r.aread()).decode(errors="replace")[:2000]
        if r.status_code == 400:
            raise InvalidRequestError(f"{self.label} rejected the request: {text}")
        raise BackendError(f"{self.label} answered {r.status_code}: {text}")

    async def sse(self, client: httpx.AsyncClient, path: str, body: dict) -> AsyncIterator[dict]:
        """POST ``body`` to ``path`` and yield each server-sent event's JSON object until ``[DONE]``; an event
        carrying an ``error`` is a BackendError naming the server."""
        async with client.stream("POST", f"{self.url}{path}", json=body) as r:
            await self.raise_for_status(r)
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BackendError(f"{self.label} failed the request: {chunk['error']}")
                yield chunk

    async def _post(self, client: httpx.AsyncClient, path: str, **kw) -> httpx.Response:
        try:
            r = await client.post(f"{self.url}{path}", timeout=600.0, **kw)
        except httpx.HTTPError as e:
            raise BackendError(f"{self.label} {path} failed: {e!r}") from e
        if r.status_code != 200:
            raise BackendError(f"{self.label} {path} answered {r.status_code}: {r.text[:1000]}")
        return r
