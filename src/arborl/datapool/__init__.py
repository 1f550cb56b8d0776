"""Durable SQLite (WAL) store of calls and episodes (the data pool, A3); see store.py for the guarantees.

store.py: the DataPool; schema.py: its tables and versions; rows.py: records <-> rows; codec.py: arrays
and dicts <-> bytes and JSON; errors.py: its exceptions; ledger.py: exactly-once counts of the stream ledger.
"""

from arborl.datapool.errors import (
    DataPoolConflictError,
    DataPoolError,
    DataPoolFullError,
    DataPoolNotFoundError,
    DataPoolSchemaError,
)
from arborl.datapool.schema import SCHEMA_VERSION
from arborl.datapool.store import DataPool

__all__ = [
    "SCHEMA_VERSION",
    "DataPool",
    "DataPoolConflictError",
    "DataPoolFullError",
    "DataPoolError",
    "DataPoolNotFoundError",
    "DataPoolSchemaError",
]
