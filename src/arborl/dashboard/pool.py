"""The run's data pool opened read-only (SQLite ``mode=ro``: the dashboard never writes, never takes a
write lock, and sees every transaction a running job has committed, WAL included), as the trajectory
browser walks it: step -> group -> episode -> calls."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from arborl.datapool.ledger import surviving
from arborl.datapool.rows import read_trainer_logprobs, row_to_call, row_to_episode
from arborl.types import ArborlError, Episode

_STEP_GROUP = re.compile(r"^step(\d+):")


class NoDataPoolError(ArborlError):
    """The run has no data pool file (yet)."""


@contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    if not path.is_file():
        raise NoDataPoolError(f"{path} does not exist: the run has recorded no episode yet")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
    conn.row_factory = sqlite3.Row
    try:
        yield conn
    finally:
        conn.close()


def bucket(group_id: str, trained_at: dict[str, int] | None = None) -> str:
    """The trajectory browser's 'step' of a group: ``step N`` for the groups training step N trained (by
    the data pool's ledger, ``trained_at``: asynchronous consumption trains groups of several draws in one
    step; without a ledger, group ``step{N-1}:task``), the group's tag for evaluation (``eval-v3``), else
    ``other``; with a ledger, a training group no step trained (yet) is ``not trained``."""
    if trained_at:
        if group_id in trained_at:
            return f"step {trained_at[group_id]}"
        if _STEP_GROUP.match(group_id):
            return "not trained"
    m = _STEP_GROUP.match(group_id)
    if m:
        return f"step {int(m.group(1)) + 1}"
    tag, sep, _ = group_id.partition(":")
    return tag if sep and tag.startswith("eval") else "other"


def _trained_at(conn: sqlite3.Connection) -> dict[str, int]:
    """Group id -> the step that trained it, over the trainings the final weights descend from ({} for a
    data pool without a ledger)."""
    try:
        trainings = [dict(r) for r in conn.execute("SELECT * FROM trainings ORDER BY rowid")]
        attempts = [dict(r) for r in conn.execute("SELECT * FROM attempts ORDER BY rowid")]
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return {}
        raise
    return {t["group_id"]: t["step"] for t in surviving(trainings, attempts)}


def buckets(path: Path) -> list[dict[str, Any]]:
    """[{"bucket", "groups": [{"group_id", "episodes", "mean_reward"}]}]: training steps in order first."""
    with read_only(path) as conn:
        rows = conn.execute(
            "SELECT group_id, COUNT(*) AS n, AVG(reward) AS r, MIN(started_at) AS t FROM episodes "
            "GROUP BY group_id ORDER BY t, group_id").fetchall()
        trained_at = _trained_at(conn)
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(bucket(r["group_id"], trained_at), []).append(
            {"group_id": r["group_id"], "episodes": r["n"], "mean_reward": r["r"]})

    def order(name: str) -> tuple[int, int, str]:
        m = re.fullmatch(r"step (\d+)", name)
        return (0, int(m.group(1)), "") if m else (1 if name != "other" else 2, 0, name)

    return [{"bucket": b, "groups": out[b]} for b in sorted(out, key=order)]


def group_episodes(path: Path, group_id: str) -> list[Episode]:
    """The group's episodes (without their calls), in start order."""
    with read_only(path) as conn:
        rows = conn.execute("SELECT * FROM episodes WHERE group_id = ? ORDER BY started_at, rowid",
                            (group_id,)).fetchall()
    return [row_to_episode(r, []) for r in rows]


def episode(path: Path, episode_id: str) -> Episode | None:
    """One episode with its calls in recording order (one read transaction: a consistent snapshot)."""
    with read_only(path) as conn:
        conn.execute("BEGIN")
        row = conn.execute("SELECT * FROM episodes WHERE episode_id = ?", (episode_id,)).fetchone()
        if row is None:
            return None
        calls = conn.execute("SELECT * FROM calls WHERE episode_id = ? ORDER BY seq", (episode_id,)).fetchall()
        conn.execute("COMMIT")
    return row_to_episode(row, [row_to_call(c) for c in calls])


def trainer_logprobs(path: Path, episode_id: str) -> dict[str, list[float]]:
    """Call id -> the trainer's log-probs of its generated tokens, of the latest step that recorded
    them (datapool/store.py ``record_trainer_logprobs``); {} for a data pool from before the table."""
    with read_only(path) as conn:
        try:
            ids = [r["call_id"] for r in conn.execute("SELECT call_id FROM calls WHERE episode_id = ?", (episode_id,))]
            return {cid: lps for cid, (_, lps) in read_trainer_logprobs(conn, ids).items()}
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return {}
            raise
