"""The data pool (datapool/): the SQLite trajectory store of a run."""

from __future__ import annotations

from pydantic import Field

from arborl.config.base import Section


class DataPoolConfig(Section):
    """The SQLite (WAL) trajectory store of a run."""

    filename: str = Field("datapool.sqlite", description="SQLite file inside the run directory")
    busy_timeout_s: float = Field(30.0, gt=0, description="how long a writer waits for a lock (seconds)")
