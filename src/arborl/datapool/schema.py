"""The data pool's SQL schema: its tables, their column lists, and opening a file at the current version.

``PRAGMA user_version`` holds the file's schema version. A file older than :data:`SCHEMA_VERSION`
gains the missing tables and indexes when opened (every statement is ``IF NOT EXISTS``); a newer
one is refused with :class:`DataPoolSchemaError`.
"""

from __future__ import annotations

import sqlite3

from arborl.datapool.errors import DataPoolSchemaError

SCHEMA_VERSION = 3  # 2: trainer_logprobs; 3: the stream ledger (attempts, stream_groups, trainings). Older files gain the tables when opened

_DDL = """
CREATE TABLE IF NOT EXISTS episodes (
    episode_id        TEXT PRIMARY KEY,
    task_id           TEXT NOT NULL,
    group_id          TEXT NOT NULL DEFAULT '',
    agent_kind        TEXT NOT NULL,
    status            TEXT NOT NULL,
    reward            REAL NULL,
    reward_components TEXT NOT NULL DEFAULT '{}',
    interactions      TEXT NOT NULL DEFAULT '[]',
    meta              TEXT NOT NULL DEFAULT '{}',
    started_at        REAL NOT NULL,
    finished_at       REAL NULL,
    min_version       INTEGER NULL,
    max_version       INTEGER NULL,
    updated_at        REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (
    call_id              TEXT PRIMARY KEY,
    episode_id           TEXT NOT NULL REFERENCES episodes(episode_id),
    seq                  INTEGER NOT NULL,
    engine_id            TEXT NOT NULL DEFAULT '',
    prompt               BLOB NOT NULL,
    completion           BLOB NOT NULL,
    logprobs             BLOB NOT NULL,
    sample_logprobs      BLOB NOT NULL,
    versions             BLOB NOT NULL,
    min_version          INTEGER NULL,
    max_version          INTEGER NULL,
    finish_reason        TEXT NOT NULL,
    created_at           REAL NOT NULL,
    latency_s            REAL NOT NULL DEFAULT 0,
    cached_prompt_tokens INTEGER NOT NULL DEFAULT 0,
    meta                 TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS trainer_logprobs (
    call_id  TEXT NOT NULL REFERENCES calls(call_id),
    step     INTEGER NOT NULL,
    logprobs BLOB NOT NULL,
    PRIMARY KEY (call_id, step)
);
CREATE TABLE IF NOT EXISTS attempts (
    attempt          INTEGER PRIMARY KEY,
    from_step        INTEGER NOT NULL,
    discarded_tokens INTEGER NOT NULL DEFAULT 0,
    started_at       REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS stream_groups (
    group_id      TEXT PRIMARY KEY,
    position      INTEGER NOT NULL,
    task_id       TEXT NOT NULL,
    start_version INTEGER NOT NULL,
    state         TEXT NOT NULL,
    reason        TEXT NOT NULL DEFAULT '',
    attempt       INTEGER NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS trainings (
    episode_id TEXT NOT NULL REFERENCES episodes(episode_id),
    group_id   TEXT NOT NULL,
    step       INTEGER NOT NULL,
    attempt    INTEGER NOT NULL,
    PRIMARY KEY (episode_id, attempt, step)
);
CREATE INDEX IF NOT EXISTS episodes_status ON episodes(status);
CREATE INDEX IF NOT EXISTS episodes_group ON episodes(group_id);
CREATE INDEX IF NOT EXISTS episodes_min_version ON episodes(min_version);
CREATE UNIQUE INDEX IF NOT EXISTS calls_episode_seq ON calls(episode_id, seq);
"""

# Columns of `calls` that hold the immutable content of a call (everything but seq).
CALL_CONTENT = (
    "episode_id, engine_id, prompt, completion, logprobs, sample_logprobs, versions, "
    "min_version, max_version, finish_reason, created_at, latency_s, cached_prompt_tokens, meta"
)
CALL_COLUMNS = "call_id, seq, " + CALL_CONTENT
EPISODE_COLUMNS = (
    "episode_id, task_id, group_id, agent_kind, status, reward, reward_components, interactions, "
    "meta, started_at, finished_at, min_version, max_version"
)


def init_schema(conn: sqlite3.Connection, path: str) -> None:
    """Bring the file behind ``conn`` to :data:`SCHEMA_VERSION` in one transaction (``path`` names it in errors)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise DataPoolSchemaError(
                f"data pool {path} has schema version {version}, but this arborl reads "
                f"up to version {SCHEMA_VERSION}: upgrade arborl to open it"
            )
        if version < SCHEMA_VERSION:
            for stmt in _DDL.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
