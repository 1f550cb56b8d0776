"""Errors the gateway answers with: each carries its HTTP status and OpenAI error type.

The body the HTTP layer sends is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``;
the message always says what to fix. The in-process client raises the same exceptions.
"""

from __future__ import annotations

from typing import Any

from arborl.types import ArborlError


class GatewayError(ArborlError):
    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequestError(GatewayError, ValueError):
    """Malformed or invalid request (400)."""

    status = 400
    type = "invalid_request_error"


class AuthenticationError(GatewayError):
    """Missing or wrong key (401). Never says whether a session exists."""

    status = 401
    type = "authentication_error"


class PermissionDeniedError(GatewayError):
    """A valid key that may not do this (403), e.g. an untrusted agent posting its own reward."""

    status = 403
    type = "permission_denied_error"


class NotFoundError(GatewayError, LookupError):
    """Unknown model, route or call (404)."""

    status = 404
    type = "not_found_error"


class ConflictError(GatewayError):
    """The session is in a state that forbids the request (409), e.g. already finished."""

    status = 409
    type = "conflict_error"


class EngineFailedError(GatewayError):
    """The engine failed while serving this call (500); the session stays usable, nothing was recorded."""

    status = 500
    type = "server_error"


class UnavailableError(GatewayError):
    """No engine can serve (503): all are shut down."""

    status = 503
    type = "server_error"
