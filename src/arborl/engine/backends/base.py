"""The errors an external inference server raises (what every engine shows is ``engine/face.py``)."""

from __future__ import annotations

from arborl.engine.face import EngineError


class BackendError(EngineError):
    """An external inference server failed; the message says what to fix."""


class ServerUnavailableError(BackendError):
    """The server died or is restarting: the request is lost, a retry is served once it is back."""
