"""The OpenAI-compatible gateway (A2, A3): sessions and keys, routing to engines, token-faithful recording.

* ``Gateway`` (core.py): the plain-Python core every path goes through;
* ``RequestRun`` (run.py): one request in flight, seeing the gateway through ``RequestContext`` (context.py);
* ``create_app`` (app.py): the FastAPI layer; ``GatewayServer`` / ``serve_forever`` (server.py): uvicorn.

Engines are placed by the engine pool (``arborl.engine.pool``); training samples are built from the
recorded calls by ``arborl.train.samples``; ``arborl.run.assemble`` builds a gateway from a config.
"""

from arborl.gateway.core import Gateway, RequestRun, SessionInfo
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
from arborl.gateway.sessions import Session

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
