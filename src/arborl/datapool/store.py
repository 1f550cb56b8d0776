"""The data pool: a durable SQLite (WAL) store of calls and episodes.

Durability: the file runs in WAL mode with ``synchronous=NORMAL``: a transaction whose commit has
returned survives the writing process being killed (SIGKILL, OOM); only an OS crash or power
loss may roll back the last few commits. Every public write method is one transaction, so a
record is either fully stored or not at all -- a bad record raises and writes nothing.

Storage: token ids and versions are little-endian int32 blobs, log-probabilities little-endian
float32 blobs (see :mod:`arborl.datapool.codec`), so ``logprobs`` / ``sample_logprobs`` read back
as their float32-rounded values. Small dicts (meta, reward components, interactions) are JSON.

Threads: one connection guarded by a lock; any thread may call any method. Other processes (or
other ``DataPool`` instances) may open the same file: WAL readers see every committed write.

Immutability: a recorded call never changes. Writing a call id again with the same content is a
no-op; with different content it raises :class:`DataPoolConflictError`. Episode rows (status,
reward, ...) are mutable; their calls are append-only.

The stream ledger (``attempts``, ``stream_groups``, ``trainings``): each start or resume of a training run
is an attempt (from the checkpoint's step); each group of the task stream has its position, state and
the attempt that last touched it; each training of an episode is (episode, step, attempt). A training
survives when no later attempt resumed from a step before it (``datapool/ledger.py`` counts them).

Trainer log-probs: the trainer's per-token log-probs of a call's generated tokens, at the step that
trained it (``record_trainer_logprobs``), float32 blobs keyed by (call, step) beside the immutable
call; the trajectory browser shows the rollout/trainer mismatch from them.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from arborl.datapool import codec
from arborl.datapool.errors import (
    DataPoolConflictError,
    DataPoolError,
    DataPoolFullError,
    DataPoolNotFoundError,
)
from arborl.datapool.rows import (
    IN_CHUNK,
    EncodedCall,
    chunks,
    episode_row,
    opt_float,
    read_trainer_logprobs,
    row_to_call,
    row_to_episode,
    status_value,
)
from arborl.datapool.schema import CALL_COLUMNS, CALL_CONTENT, EPISODE_COLUMNS, init_schema
from arborl.types import Call, Episode, EpisodeStatus, InvalidRequestError

if TYPE_CHECKING:
    from arborl.config import DataPoolConfig

_ORDERS = ("started_at", "updated_at", "finished_at", "reward", "episode_id", "min_version", "max_version")


class DataPool:
    """Durable store of episodes and their calls (see the module docstring).

    ``DataPool(path)`` creates the file (and its parent directory) if needed. ``":memory:"``
    gives a private in-memory store (no WAL, no durability) for quick experiments.
    """

    def __init__(self, path: str | Path, busy_timeout_s: float = 30.0) -> None:
        if busy_timeout_s <= 0:
            raise InvalidRequestError(f"busy_timeout_s must be > 0, got {busy_timeout_s}")
        self.path = str(path)
        self.busy_timeout_s = float(busy_timeout_s)
        self._lock = threading.RLock()
        memory = self.path == ":memory:"
        if not memory:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise DataPoolError(f"cannot open data pool {self.path}: {e}") from e
        self._conn: sqlite3.Connection | None = conn
        try:
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if not memory and str(mode).lower() != "wal":
                raise DataPoolError(
                    f"data pool {self.path}: SQLite refused WAL mode (journal_mode={mode}); "
                    "put the run directory on a local filesystem"
                )
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            init_schema(conn, self.path)
        except sqlite3.DatabaseError as e:
            conn.close()
            self._conn = None
            raise DataPoolError(f"data pool {self.path} is not a readable SQLite database: {e}") from e
        except BaseException:
            conn.close()
            self._conn = None
            raise

    @classmethod
    def from_config(cls, run_dir: str | Path, cfg: "DataPoolConfig") -> "DataPool":
        return cls(Path(run_dir) / cfg.filename, busy_timeout_s=cfg.busy_timeout_s)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @property
    def closed(self) -> bool:
        return self._conn is None

    def __enter__(self) -> "DataPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DataPool({self.path!r}{', closed' if self.closed else ''})"

    _SETTINGS = ("journal_mode", "synchronous", "foreign_keys", "busy_timeout", "user_version")

    def setting(self, name: str) -> Any:
        """The value this pool's own connection reports for the SQLite setting ``name`` (one of
        journal_mode, synchronous, foreign_keys, busy_timeout, user_version). Read-only: for checks and
        diagnostics (most of these are per connection, so another connection to the file cannot tell)."""
        if name not in self._SETTINGS:
            raise InvalidRequestError(f"unknown setting {name!r}; readable: {', '.join(self._SETTINGS)}")
        with self._lock:
            return self._c().execute(f"PRAGMA {name}").fetchone()[0]

    def _c(self) -> sqlite3.Connection:
        if self._conn is None:
            raise DataPoolError(f"data pool {self.path} is closed")
        return self._conn

    def _write(self, fn: Any, *args: Any) -> Any:
        """Run fn(conn, *args) in one IMMEDIATE transaction; roll back on any error."""
        with self._lock:
            conn = self._c()
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = fn(conn, *args)
                conn.execute("COMMIT")
            except BaseException as e:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(e, sqlite3.OperationalError) and getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                    raise DataPoolFullError(
                        f"data pool {self.path}: the disk is full ({e}); this write stored nothing and every earlier "
                        "record is intact: free space on that filesystem (or move the run directory) and writes "
                        "succeed again") from e
                raise
            return out

    def _read(self, fn: Any, *args: Any) -> Any:
        """Run fn(conn, *args) in one read transaction (a consistent snapshot)."""
        with self._lock:
            conn = self._c()
            conn.execute("BEGIN")
            try:
                return fn(conn, *args)
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")

    # ------------------------------------------------------------------ writes

    def put_episode(self, ep: Episode) -> None:
        """Upsert the episode row and insert its calls idempotently, in one transaction.

        Every field of the episode row is overwritten with ``ep``'s; calls already stored but
        absent from ``ep.calls`` are kept (calls are append-only). New calls get the next seq
        numbers in ``ep.calls`` order; already stored calls keep theirs.
        """
        if not isinstance(ep, Episode):
            raise InvalidRequestError(f"expected an Episode, got {type(ep).__name__}")
        if not ep.episode_id or not isinstance(ep.episode_id, str):
            raise InvalidRequestError("episode_id must be a non-empty string")
        eid = ep.episode_id
        calls = [EncodedCall(c) for c in ep.calls]
        seen: set[str] = set()
        for c in calls:
            if c.episode_id != eid:
                raise InvalidRequestError(f"call {c.call_id} belongs to episode {c.episode_id}, not {eid}")
            if c.call_id in seen:
                raise InvalidRequestError(f"episode {eid} lists call {c.call_id} twice")
            seen.add(c.call_id)
        row = episode_row(ep)

        def tx(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO episodes (episode_id, task_id, group_id, agent_kind, status, reward, "
                "reward_components, interactions, meta, started_at, finished_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(episode_id) DO UPDATE SET task_id=excluded.task_id, "
                "group_id=excluded.group_id, agent_kind=excluded.agent_kind, status=excluded.status, "
                "reward=excluded.reward, reward_components=excluded.reward_components, "
                "interactions=excluded.interactions, meta=excluded.meta, "
                "started_at=excluded.started_at, finished_at=excluded.finished_at, "
                "updated_at=excluded.updated_at",
                row + (time.time(),),
            )
            for c in calls:
                self._insert_call(conn, c)
            self._refresh_versions(conn, eid)

        self._write(tx)

    def add_call(self, call: Call) -> int:
        """Append ``call`` to its (existing) episode; returns its seq. Idempotent per call id."""
        enc = EncodedCall(call)

        def tx(conn: sqlite3.Connection) -> int:
            if conn.execute("SELECT 1 FROM episodes WHERE episode_id = ?", (enc.episode_id,)).fetchone() is None:
                raise DataPoolNotFoundError(
                    f"call {enc.call_id}: episode {enc.episode_id} is not in the data pool; "
                    "put_episode it before adding calls"
                )
            seq, new = self._insert_call(conn, enc)
            if new:
                self._refresh_versions(conn, enc.episode_id)
            return seq

        return self._write(tx)

    def update_episode(
        self,
        episode_id: str,
        *,
        status: EpisodeStatus | str | None = None,
        reward: float | None = None,
        reward_components: dict[str, float] | None = None,
        interactions: list[dict[str, Any]] | None = None,
        meta: dict[str, Any] | None = None,
        finished_at: float | None = None,
    ) -> None:
        """Set the given fields of an episode (None = leave unchanged); unknown id -> error."""
        sets: list[str] = []
        vals: list[Any] = []
        if status is not None:
            sets.append("status = ?")
            vals.append(status_value(status))
        if reward is not None:
            sets.append("reward = ?")
            vals.append(opt_float(reward, f"episode {episode_id}: reward"))
        if reward_components is not None:
            sets.append("reward_components = ?")
            vals.append(codec.encode_json(reward_components, f"episode {episode_id}: reward_components"))
        if interactions is not None:
            sets.append("interactions = ?")
            vals.append(codec.encode_json(interactions, f"episode {episode_id}: interactions"))
        if meta is not None:
            sets.append("meta = ?")
            vals.append(codec.encode_json(meta, f"episode {episode_id}: meta"))
        if finished_at is not None:
            sets.append("finished_at = ?")
            vals.append(opt_float(finished_at, f"episode {episode_id}: finished_at"))
        sets.append("updated_at = ?")
        vals.append(time.time())

        def tx(conn: sqlite3.Connection) -> None:
            cur = conn.execute(f"UPDATE episodes SET {', '.join(sets)} WHERE episode_id = ?", (*vals, episode_id))
            if cur.rowcount == 0:
                raise DataPoolNotFoundError(f"episode {episode_id} is not in the data pool")

        self._write(tx)

    # ------------------------------------------------------------------ the stream ledger

    def begin_attempt(self, from_step: int, discarded_tokens: int = 0) -> int:
        """Record a start (``from_step`` 0) or a resume of the run; returns the attempt's number (1, 2, ...)."""
        def tx(conn: sqlite3.Connection) -> int:
            last = conn.execute("SELECT COALESCE(MAX(attempt), 0) FROM attempts").fetchone()[0]
            conn.execute("INSERT INTO attempts VALUES (?, ?, ?, ?)", (last + 1, int(from_step), int(discarded_tokens),
                                                                     time.time()))
            return last + 1

        return self._write(tx)

    def attempt(self) -> int:
        """The latest attempt's number (0 before the first)."""
        return int(self._read(lambda conn: conn.execute("SELECT COALESCE(MAX(attempt), 0) FROM attempts").fetchone()[0]))

    def record_group(self, group_id: str, *, position: int, task_id: str, start_version: int, state: str,
                     attempt: int, reason: str = "") -> None:
        """A group of the task stream started or changed state (running, finished, trained, dropped, cancelled, failed)."""
        self._write(lambda conn: conn.execute(
            "INSERT INTO stream_groups VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(group_id) DO UPDATE SET "
            "position = excluded.position, start_version = excluded.start_version, state = excluded.state, "
            "reason = excluded.reason, attempt = excluded.attempt, updated_at = excluded.updated_at",
            (group_id, int(position), task_id, int(start_version), state, reason, int(attempt), time.time())))

    def set_group_state(self, group_ids: Iterable[str], state: str, reason: str = "") -> None:
        ids = list(group_ids)

        def tx(conn: sqlite3.Connection) -> None:
            for chunk in chunks(ids, IN_CHUNK):
                conn.execute(f"UPDATE stream_groups SET state = ?, reason = ?, updated_at = ? WHERE group_id IN "
                             f"({', '.join('?' * len(chunk))})", [state, reason, time.time(), *chunk])

        if ids:
            self._write(tx)

    def record_trainings(self, step: int, attempt: int, episodes: Iterable[tuple[str, str]]) -> None:
        """Step ``step`` (1-based) of ``attempt`` trained these (episode id, group id)s; their groups are 'trained'."""
        rows = [(e, g, int(step), int(attempt)) for e, g in episodes]

        def tx(conn: sqlite3.Connection) -> None:
            conn.executemany("INSERT OR IGNORE INTO trainings VALUES (?, ?, ?, ?)", rows)
            now = time.time()
            conn.executemany("UPDATE stream_groups SET state = 'trained', reason = '', updated_at = ? WHERE group_id = ?",
                             [(now, g) for g in {r[1] for r in rows}])

        self._write(tx)

    def ledger(self) -> dict[str, list[dict[str, Any]]]:
        """The stream ledger's three tables as rows (dicts), for the exactly-once counts."""
        def rd(conn: sqlite3.Connection) -> dict[str, list[dict[str, Any]]]:
            return {t: [dict(r) for r in conn.execute(f"SELECT * FROM {t} ORDER BY rowid")]
                    for t in ("attempts", "stream_groups", "trainings")}

        return self._read(rd)

    def record_trainer_logprobs(self, step: int, logprobs: dict[str, Sequence[float]]) -> None:
        """The trainer's log-probs of each call's generated tokens (call id -> one per completion
        token) at training step ``step``, in one transaction; recording a (call, step) again replaces
        it. A call id not in the data pool raises DataPoolNotFoundError and writes nothing."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidRequestError(f"step must be an integer >= 0, got {step!r}")
        rows = [(cid, step, codec.encode_f32(lps, f"trainer log-probs of call {cid}"), len(lps))
                for cid, lps in logprobs.items()]

        def tx(conn: sqlite3.Connection) -> None:
            for cid, st, blob, n in rows:
                row = conn.execute("SELECT completion FROM calls WHERE call_id = ?", (cid,)).fetchone()
                if row is None:
                    raise DataPoolNotFoundError(f"call {cid} is not in the data pool: record its trainer "
                                                "log-probs after the call")
                want = len(row["completion"]) // codec.I32.itemsize
                if n != want:
                    raise InvalidRequestError(f"trainer log-probs of call {cid}: {n} values for its {want} "
                                              "completion tokens")
                conn.execute("INSERT OR REPLACE INTO trainer_logprobs (call_id, step, logprobs) VALUES (?, ?, ?)",
                             (cid, st, blob))

        self._write(tx)

    def trainer_logprobs(self, call_ids: Iterable[str]) -> dict[str, tuple[int, list[float]]]:
        """call id -> (step, the trainer's log-probs) of the latest step that recorded each call; calls
        without any are left out."""
        return self._read(read_trainer_logprobs, list(call_ids))

    @staticmethod
    def _insert_call(conn: sqlite3.Connection, c: EncodedCall) -> tuple[int, bool]:
        """Insert one call (or check it equals the stored one). Returns (seq, inserted)."""
        row = conn.execute(f"SELECT seq, {CALL_CONTENT} FROM calls WHERE call_id = ?", (c.call_id,)).fetchone()
        if row is not None:
            stored = tuple(row)[1:]
            if stored != c.content:
                names = [n.strip() for n in CALL_CONTENT.split(",")]
                diff = [n for n, a, b in zip(names, stored, c.content) if a != b]
                raise DataPoolConflictError(
                    f"call {c.call_id} is already recorded with different {', '.join(diff)}: "
                    "recorded calls are immutable (give the new call a new call_id)"
                )
            return int(row["seq"]), False
        seq = conn.execute(
            "SELECT COALESCE(MAX(seq) + 1, 0) FROM calls WHERE episode_id = ?", (c.episode_id,)
        ).fetchone()[0]
        conn.execute(
            f"INSERT INTO calls ({CALL_COLUMNS}) VALUES ({', '.join('?' * (2 + len(c.content)))})",
            (c.call_id, seq, *c.content),
        )
        return int(seq), True

    @staticmethod
    def _refresh_versions(conn: sqlite3.Connection, episode_id: str) -> None:
        conn.execute(
            "UPDATE episodes SET "
            "min_version = (SELECT MIN(min_version) FROM calls WHERE episode_id = ?1), "
            "max_version = (SELECT MAX(max_version) FROM calls WHERE episode_id = ?1), "
            "updated_at = ?2 WHERE episode_id = ?1",
            (episode_id, time.time()),
        )

    # ------------------------------------------------------------------ reads

    def get_call(self, call_id: str) -> Call | None:
        def rd(conn: sqlite3.Connection) -> Call | None:
            row = conn.execute(f"SELECT {CALL_COLUMNS} FROM calls WHERE call_id = ?", (call_id,)).fetchone()
            return None if row is None else row_to_call(row)

        return self._read(rd)

    def calls(self, episode_id: str) -> list[Call]:
        """The episode's calls in seq order ([] for an unknown episode)."""
        return self._read(lambda conn: self._calls_of(conn, [episode_id]).get(episode_id, []))

    def get_episode(self, episode_id: str, with_calls: bool = True) -> Episode | None:
        def rd(conn: sqlite3.Connection) -> Episode | None:
            row = conn.execute(
                f"SELECT {EPISODE_COLUMNS} FROM episodes WHERE episode_id = ?", (episode_id,)
            ).fetchone()
            if row is None:
                return None
            calls = self._calls_of(conn, [episode_id]).get(episode_id, []) if with_calls else []
            return row_to_episode(row, calls)

        return self._read(rd)

    def episodes(
        self,
        *,
        status: EpisodeStatus | str | Iterable[EpisodeStatus | str] | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        with_calls: bool = True,
        limit: int | None = None,
        order: str = "started_at",
    ) -> list[Episode]:
        """Episodes matching every given filter.

        ``min_version=v`` keeps episodes whose every token has version >= v (the episode's
        oldest token version is >= v); ``max_version=v`` keeps those whose newest token version
        is <= v. Episodes without any generated token have no version and are left out by either
        filter. ``order`` is a column among started_at, updated_at, finished_at, reward,
        episode_id, min_version, max_version, prefixed with ``-`` for descending; ties go in
        insertion order.
        """
        where, params = self._filters(status=status, group_id=group_id, task_id=task_id)
        if min_version is not None:
            where.append("min_version >= ?")
            params.append(int(min_version))
        if max_version is not None:
            where.append("max_version <= ?")
            params.append(int(max_version))
        desc = order.startswith("-")
        col = order[1:] if desc else order
        if col not in _ORDERS:
            raise InvalidRequestError(f"order must be one of {', '.join(_ORDERS)} (optionally '-' first), got {order!r}")
        sql = f"SELECT {EPISODE_COLUMNS} FROM episodes"
        if where:
            sql += " WHERE " + " AND ".join(where)
        direction = "DESC" if desc else "ASC"
        sql += f" ORDER BY {col} {direction}, rowid {direction}"
        if limit is not None:
            if int(limit) < 0:
                raise InvalidRequestError(f"limit must be >= 0, got {limit}")
            sql += " LIMIT ?"
            params.append(int(limit))

        def rd(conn: sqlite3.Connection) -> list[Episode]:
            rows = conn.execute(sql, params).fetchall()
            by_ep = self._calls_of(conn, [r["episode_id"] for r in rows]) if with_calls and rows else {}
            return [row_to_episode(r, by_ep.get(r["episode_id"], [])) for r in rows]

        return self._read(rd)

    def count_episodes(self, status: EpisodeStatus | str | Iterable[EpisodeStatus | str] | None = None) -> int:
        where, params = self._filters(status=status)
        sql = "SELECT COUNT(*) FROM episodes" + (" WHERE " + " AND ".join(where) if where else "")
        return int(self._read(lambda conn: conn.execute(sql, params).fetchone()[0]))

    def group_ids(self, status: EpisodeStatus | str | Iterable[EpisodeStatus | str] | None = None) -> list[str]:
        """Distinct non-empty group ids of the matching episodes, oldest group (first start) first."""
        where, params = self._filters(status=status)
        where.append("group_id != ''")
        sql = (
            "SELECT group_id FROM episodes WHERE " + " AND ".join(where)
            + " GROUP BY group_id ORDER BY MIN(started_at), group_id"
        )
        return self._read(lambda conn: [r[0] for r in conn.execute(sql, params).fetchall()])

    @staticmethod
    def _filters(
        *,
        status: EpisodeStatus | str | Iterable[EpisodeStatus | str] | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
    ) -> tuple[list[str], list[Any]]:
        where: list[str] = []
        params: list[Any] = []
        if status is not None:
            if isinstance(status, (str, EpisodeStatus)):
                statuses = [status_value(status)]
            else:
                statuses = [status_value(s) for s in status]
            if not statuses:
                where.append("0")
            else:
                where.append(f"status IN ({', '.join('?' * len(statuses))})")
                params.extend(statuses)
        if group_id is not None:
            where.append("group_id = ?")
            params.append(group_id)
        if task_id is not None:
            where.append("task_id = ?")
            params.append(task_id)
        return where, params

    @staticmethod
    def _calls_of(conn: sqlite3.Connection, episode_ids: Sequence[str]) -> dict[str, list[Call]]:
        out: dict[str, list[Call]] = {}
        for chunk in chunks(list(dict.fromkeys(episode_ids)), IN_CHUNK):
            rows = conn.execute(
                f"SELECT {CALL_COLUMNS} FROM calls WHERE episode_id IN ({', '.join('?' * len(chunk))}) "
                "ORDER BY episode_id, seq",
                list(chunk),
            ).fetchall()
            for r in rows:
                out.setdefault(r["episode_id"], []).append(row_to_call(r))
        return out
