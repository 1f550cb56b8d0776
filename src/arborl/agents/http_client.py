"""A session-bound client over HTTP: what a white-box agent gets when it runs in a rollout worker.

It has the interface of ``SessionClient`` (``chat``, ``chat_completion``, ``completion``, ``reward``,
``interaction``, ``trajectory``), so an agent loop runs unchanged in the controller's process or in
a worker; here every call is an HTTP request to the gateway with the session's key, recorded by the
same path as any black-box program's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from arborl.agents.client import ChatMixin
from arborl.types import ArborlError


class GatewayHTTPError(ArborlError):
    """The gateway answered an HTTP error; ``status`` >= 500 (or no answer at all) is retryable."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status >= 500


class HttpSessionClient(ChatMixin):
    """``SessionClient``'s interface over HTTP (``base_url`` ends in ``/v1``)."""

    def __init__(self, base_url: str, session_id: str, api_key: str, model: str, *,
                 http: httpx.AsyncClient | None = None, timeout_s: float = 600.0,
                 unix_socket: str | Path | None = None, harness_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.harness_key = harness_key  # posts rewards; the agent key is what a program it starts is given
        self.unix_socket = Path(unix_socket) if unix_socket else None
        self._session_id = session_id
        self.api_key = api_key
        self._model = model
        self._own = http is None
        self.http = http or httpx.AsyncClient(timeout=timeout_s)

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def model(self) -> str:
        return self._model

    @contextlib.asynccontextmanager
    async def gateway_socket(self) -> AsyncIterator[Path]:
        """The gateway's Unix socket (the controller serves one for its rollout workers)."""
        if self.unix_socket is None:
            raise GatewayHTTPError("this worker was given no gateway Unix socket, so a sandboxed program cannot "
                                   "reach the gateway", None)
        yield self.unix_socket

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    async def _post(self, path: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        try:
            r = await self.http.post(f"{self.base_url}{path}", json=body,
                                     headers={"Authorization": f"Bearer {key or self.api_key}"})
        except httpx.HTTPError as e:
            raise GatewayHTTPError(f"POST {path}: the gateway did not answer ({type(e).__name__}: {e})", None) from e
        if r.status_code >= 400:
            try:
                msg = r.json().get("error", {}).get("message", r.text)
            except ValueError:
                msg = r.text
            raise GatewayHTTPError(f"POST {path}: HTTP {r.status_code}: {msg}", r.status_code)
        return r.json()

    async def chat_completion(self, **body: Any) -> dict[str, Any]:
        return await self._post("/chat/completions", body)

    async def completion(self, **body: Any) -> dict[str, Any]:
        return await self._post("/completions", body)

    async def reward(self, value: float, *, name: str = "agent", call_id: str | None = None) -> None:
        await self._post(f"/sessions/{self.session_id}/reward", {"value": value, "name": name, "call_id": call_id},
                         key=self.harness_key)

    async def interaction(self, **record: Any) -> None:
        await self._post(f"/sessions/{self.session_id}/interaction", record)

    async def trajectory(self) -> dict[str, Any]:
        r = await self.http.get(f"{self.base_url}/sessions/{self.session_id}/trajectory",
                                headers={"Authorization": f"Bearer {self.api_key}"})
        r.raise_for_status()
        return r.json()
