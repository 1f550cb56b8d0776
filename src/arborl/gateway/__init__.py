"""The OpenAI-compatible gateway (A2, A3): sessions and keys, routing to engines, token-faithful recording.

* ``Gateway`` (core.py): the plain-Python core every path goes through;
* ``RequestRun`` (run.py): one request in flight, seeing the gateway through ``RequestContext`` (context.py);
* ``create_app`` (app.py): the FastAPI layer; ``GatewayServer`` / ``serve_forever`` (server.py): uvicorn.

Engines are placed by the engine pool (``arborl.engine.pool``); training samples are built from the
recorded calls by ``arborl.train.samples``; ``arborl.run.assemble`` builds a gateway from a config.

``Gateway`` and ``RequestRun`` load on first use: they bring the engine (and torch) with them, which a
rollout worker that only speaks HTTP to the gateway, or reads its errors, never needs.
"""

from typing import TYPE_CHECKING, Any

from arborl.gateway.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    EngineFailedError,
    GatewayError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from arborl.gateway.sessions import Session, SessionInfo

if TYPE_CHECKING:
    from arborl.gateway.core import Gateway
    from arborl.gateway.run import RequestRun

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "EngineFailedError",
    "Gateway",
    "GatewayError",
    "NotFoundError",
    "PermissionDeniedError",
    "RequestRun",
    "Session",
    "SessionInfo",
    "UnavailableError",
]


def __getattr__(name: str) -> Any:
    if name == "Gateway":
        from arborl.gateway.core import Gateway

        return Gateway
    if name == "RequestRun":
        from arborl.gateway.run import RequestRun

        return RequestRun
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
