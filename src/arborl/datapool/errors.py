"""The data pool's exceptions, all under :class:`DataPoolError`."""

from __future__ import annotations

from arborl.types import ArborlError


class DataPoolError(ArborlError):
    """The data pool cannot do what was asked (closed, unreadable file, ...)."""


class DataPoolConflictError(DataPoolError, ValueError):
    """A call id is already recorded with different content: recorded calls are immutable."""


class DataPoolNotFoundError(DataPoolError, LookupError):
    """The episode a write refers to is not in the data pool."""


class DataPoolFullError(DataPoolError, OSError):
    """The data pool's disk is full: the write stored nothing, every earlier record is intact, and writes
    succeed again once space is freed."""


class DataPoolSchemaError(DataPoolError):
    """The file's schema version is not one this arborl can read."""
