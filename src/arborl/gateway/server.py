"""Running the gateway's app on uvicorn: in a background thread, or in the foreground (``arborl serve``)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from arborl.gateway.app import create_app
from arborl.gateway.core import Gateway


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); a clear OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only for sockets
    # that say they are TCP; without it Nagle + delayed ACK add ~40 ms to every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port (0 = any free port)") from e
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _config(gateway: Gateway, log_level: str, mounts: dict[str, Any] | None = None) -> uvicorn.Config:
    app = create_app(gateway)
    for path, sub in (mounts or {}).items():  # other ASGI apps beside the gateway's routes (the dashboard)
        app.mount(path, sub)
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=30,
    )


class GatewayServer:
    """The gateway on a loopback port, served by uvicorn in a daemon thread (its own event loop).

    ``with GatewayServer(gw) as srv: openai.OpenAI(base_url=srv.base_url, api_key=...)``.
    ``port=0`` picks a free port; ``srv.port`` tells which.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning") -> None:
        self.gateway = gateway
        self.host = host
        self._sock = bind(host, port)
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(_config(gateway, log_level))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def socket(self):
        """The listening socket (bound at construction, before the server starts)."""
        return self._sock

    def start(self, timeout_s: float = 30.0) -> "GatewayServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="arborl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway server did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful: stops accepting, finishes and records the requests in flight."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> "GatewayServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(gateway: Gateway, sock: socket.socket, *, on_ready=None, log_level: str = "warning",
                  mounts: dict[str, Any] | None = None) -> None:
    """Serve on the bound ``sock`` in the foreground until Ctrl-C / SIGTERM (uvicorn handles the signals);
    ``mounts``: path -> ASGI app served beside the gateway."""
    if on_ready is not None:
        on_ready(sock.getsockname()[1])
    try:
        uvicorn.Server(_config(gateway, log_level, mounts)).run(sockets=[sock])
    finally:
        sock.close()
