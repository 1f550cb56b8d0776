"""The gateway over HTTP on the caller's own event loop, for black-box programs started during a run
(the ``command`` agent): ``async with serve_http(gateway) as base_url: ...``.

The first user starts a uvicorn server for ``gateway`` on a free loopback port, as a task of the
running event loop -- the loop the gateway and its engines already run on, so no request crosses a
thread. Later users on that loop share it; when the last one leaves, it stops (it closes its
connections and lets the requests in flight finish; the gateway itself is not drained or closed).
uvicorn's own signal handlers are not installed: Ctrl-C reaches the job as it always does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from arborl.types import ArborlError

if TYPE_CHECKING:
    from arborl.gateway.core import Gateway


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the job keeps its signal handling
        yield


@dataclass
class _Served:
    loop: asyncio.AbstractEventLoop
    server: _Server
    task: asyncio.Task
    base_url: str
    users: int = 0


_SERVED: "weakref.WeakKeyDictionary[Gateway, _Served]" = weakref.WeakKeyDictionary()


def _serve(gateway: Gateway, sock: socket.socket, base_url: str) -> _Served:
    from arborl.gateway.app import create_app  # the gateway's app and core only where one is served

    config = uvicorn.Config(create_app(gateway), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=10)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="arborl-gateway-http")
    return _Served(asyncio.get_running_loop(), server, task, base_url)


def _start(gateway: Gateway, host: str) -> _Served:
    from arborl.gateway.server import bind

    sock = bind(host, 0)
    shown = f"[{host}]" if ":" in host else host
    return _serve(gateway, sock, f"http://{shown}:{sock.getsockname()[1]}/v1")


async def _ready(s: _Served, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not s.server.started:
        if s.task.done():
            err = s.task.exception() if not s.task.cancelled() else None
            raise ArborlError(f"the gateway's HTTP server stopped before it served: {err!r}")
        if asyncio.get_running_loop().time() > deadline:
            raise ArborlError(f"the gateway's HTTP server did not start within {timeout_s} s")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def serve_http(gateway: Gateway, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """The base URL (``http://HOST:PORT/v1``) of ``gateway`` served on this event loop while inside."""
    loop = asyncio.get_running_loop()
    s = _SERVED.get(gateway)
    if s is None or s.loop is not loop or s.task.done() or s.server.should_exit:
        s = _SERVED[gateway] = _start(gateway, host)
    s.users += 1
    try:
        await _ready(s)
        yield s.base_url
    finally:
        s.users -= 1
        if s.users == 0:
            s.server.should_exit = True
            if _SERVED.get(gateway) is s:
                del _SERVED[gateway]


@contextlib.asynccontextmanager
async def serve_unix(gateway: Gateway) -> AsyncIterator[Path]:
    """``gateway`` served over a fresh Unix socket while inside; yields the socket's path.

    For agents in a sandbox with no network: the socket is bound into the sandbox, and any local user
    may connect to it (each episode's key still limits a caller to its own session)."""
    d = Path(tempfile.mkdtemp(prefix="arborl-gw-"))
    os.chmod(d, 0o755)  # the sandbox's unprivileged uid must reach the socket
    path = d / "gateway.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o777)
    sock.listen(128)
    s = _serve(gateway, sock, f"http://localhost/v1 (unix socket {path})")
    try:
        await _ready(s)
        yield path
    finally:
        s.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(s.task, 15)
        path.unlink(missing_ok=True)
        d.rmdir()
