"""The OpenAI-compatible gateway: sessions and keys, routing to engines, token-faithful recording.

* ``Gateway`` (core.py): the plain-Python core every path goes through;
* ``create_app`` (app.py): the FastAPI layer; ``GatewayServer`` / ``serve_forever`` (server.py): uvicorn;
* ``episode_samples`` / ``SampleTokens`` (samples.py): recorded calls -> trainer token sequences;
* ``build_gateway`` (launch.py): model + engines + data pool from a config.
"""

from arborl.gateway.core import Gateway, RequestRun, SessionInfo
from arborl.gateway.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    EngineFailedError,
    GatewayError,
    NotFoundError,
    UnavailableError,
)
from arborl.gateway.samples import SampleTokens, episode_samples
from arborl.gateway.sessions import Session

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "EngineFailedError",
    "Gateway",
    "GatewayError",
    "NotFoundError",
    "RequestRun",
    "SampleTokens",
    "Session",
    "SessionInfo",
    "UnavailableError",
    "episode_samples",
]
