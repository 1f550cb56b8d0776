"""Durable SQLite (WAL) store of calls and episodes (the data pool, A3); see store.py for the guarantees."""

from arborl.datapool.store import (
    SCHEMA_VERSION,
    DataPool,
    DataPoolConflictError,
    DataPoolFullError,
    DataPoolError,
    DataPoolNotFoundError,
    DataPoolSchemaError,
)

__all__ = [
    "SCHEMA_VERSION",
    "DataPool",
    "DataPoolConflictError",
    "DataPoolFullError",
    "DataPoolError",
    "DataPoolNotFoundError",
    "DataPoolSchemaError",
]
