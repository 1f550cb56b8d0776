"""The data pool: SQLite (WAL) store of calls and episodes."""

from __future__ import annotations

import contextlib
import importlib.util
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from arborl.config import DataPoolConfig
from arborl.datapool import (
    SCHEMA_VERSION,
    DataPool,
    DataPoolConflictError,
    DataPoolError,
    DataPoolNotFoundError,
    DataPoolSchemaError,
)
from arborl.types import ArborlError, Call, Episode, EpisodeStatus, InvalidRequestError

WRITER = Path(__file__).parent / "helpers" / "datapool_writer.py"


def raw(pool: DataPool):
    """A separate plain SQLite connection to the pool's file: what any other reader of it sees."""
    return contextlib.closing(sqlite3.connect(pool.path))


def _load_writer():
    spec = importlib.util.spec_from_file_location("datapool_writer", WRITER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_call(episode_id: str, n: int = 5, version: int = 0, seed: int = 0, **kw) -> Call:
    rng = np.random.default_rng(seed)
    return Call(
        episode_id=episode_id,
        prompt_token_ids=rng.integers(0, 49152, size=7).tolist(),
        completion_token_ids=rng.integers(0, 49152, size=n).tolist(),
        logprobs=(-rng.random(n) * 5).tolist(),
        sample_logprobs=(-rng.random(n) * 5).tolist(),
        versions=[version + (k % 2) for k in range(n)] if n else [],
        finish_reason="stop",
        **kw,
    )


def make_episode(n_calls: int = 2, version: int = 0, **kw) -> Episode:
    ep = Episode(task_id=kw.pop("task_id", "t0"), **kw)
    ep.calls = [make_call(ep.episode_id, n=3 + i, version=version, seed=i) for i in range(n_calls)]
    return ep


def f32(xs):
    return np.asarray(xs, dtype=np.float32).astype(np.float64).tolist()


def assert_call_equal(got: Call, want: Call) -> None:
    assert got.call_id == want.call_id
    assert got.episode_id == want.episode_id
    assert got.prompt_token_ids == list(want.prompt_token_ids)
    assert got.completion_token_ids == list(want.completion_token_ids)
    assert got.versions == list(want.versions)
    # logprobs are stored as float32: they read back float32-rounded.
    assert got.logprobs == f32(want.logprobs)
    assert got.sample_logprobs == f32(want.sample_logprobs)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
    assert got.finish_reason == want.finish_reason
    assert got.engine_id == want.engine_id
    assert got.created_at == want.created_at
    assert got.latency_s == want.latency_s
    assert got.cached_prompt_tokens == want.cached_prompt_tokens
    assert got.meta == want.meta


@pytest.fixture
def pool(tmp_path):
    with DataPool(tmp_path / "pool.sqlite") as p:
        yield p


def test_pragmas_and_schema(tmp_path):
    path = tmp_path / "sub" / "pool.sqlite"
    with DataPool(path, busy_timeout_s=2.5) as p:
        assert p.setting("journal_mode") == "wal"
        assert p.setting("foreign_keys") == 1
        assert p.setting("synchronous") == 1  # NORMAL
        assert p.setting("busy_timeout") == 2500
        assert p.setting("user_version") == SCHEMA_VERSION
        with pytest.raises(InvalidRequestError, match="unknown setting"):
            p.setting("wal_checkpoint")
        with raw(p) as conn:  # the file itself: WAL and the schema, whoever opens it
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            idx = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"episodes_status", "episodes_group", "episodes_min_version", "calls_episode_seq"} <= idx
    # Reopening an existing file keeps it.
    with DataPool(path) as p:
        assert p.count_episodes() == 0


def test_round_trip(pool):
    ep = make_episode(n_calls=3, version=4, group_id="g1", reward=0.5)
    ep.calls.append(make_call(ep.episode_id, n=0, seed=9))  # a call with no completion tokens
    ep.calls[0].meta = {"parse_error": "bad json", "nested": {"a": [1, 2]}}
    ep.calls[1].engine_id = "engine-3"
    ep.calls[1].cached_prompt_tokens = 4
    ep.calls[1].latency_s = 0.125
    ep.interactions = [{"tool": "calc", "result": "4"}]
    ep.reward_components = {"correct": 1.0, "format": -0.5}
    ep.meta = {"seed": 3}
    pool.put_episode(ep)

    got = pool.get_episode(ep.episode_id)
    assert got is not None
    assert (got.task_id, got.group_id, got.agent_kind, got.status) == ("t0", "g1", "whitebox", EpisodeStatus.RUNNING)
    assert isinstance(got.status, EpisodeStatus)
    assert got.reward == 0.5 and got.reward_components == ep.reward_components
    assert got.interactions == ep.interactions and got.meta == ep.meta
    assert got.started_at == ep.started_at and got.finished_at is None
    assert len(got.calls) == 4
    for g, w in zip(got.calls, ep.calls):
        assert_call_equal(g, w)
    assert got.min_version() == 4
    assert [c.call_id for c in pool.calls(ep.episode_id)] == [c.call_id for c in ep.calls]
    assert_call_equal(pool.get_call(ep.calls[2].call_id), ep.calls[2])
    assert pool.get_call("nope") is None and pool.get_episode("nope") is None
    assert pool.calls("nope") == []
    assert pool.get_episode(ep.episode_id, with_calls=False).calls == []

    # Stored compactly: 4 bytes a token, blobs, not JSON text; episode version range maintained.
    with raw(pool) as conn:
        row = conn.execute(
            "SELECT typeof(completion), length(completion), length(logprobs), length(versions), min_version, max_version "
            "FROM calls WHERE call_id = ?",
            (ep.calls[0].call_id,),
        ).fetchone()
        n = len(ep.calls[0].completion_token_ids)
        assert tuple(row) == ("blob", 4 * n, 4 * n, 4 * n, 4, 5)
        assert tuple(conn.execute("SELECT min_version, max_version FROM episodes").fetchone()) == (4, 5)
        assert [r[0] for r in conn.execute("SELECT seq FROM calls ORDER BY seq")] == [0, 1, 2, 3]


def test_add_call_and_update(pool):
    ep = make_episode(n_calls=1, version=2)
    pool.put_episode(ep)
    c2 = make_call(ep.episode_id, n=4, version=7, seed=5)
    assert pool.add_call(c2) == 1
    assert pool.add_call(c2) == 1  # idempotent
    c3 = make_call(ep.episode_id, n=2, version=1, seed=6)
    assert pool.add_call(c3) == 2
    got = pool.get_episode(ep.episode_id)
    assert [c.call_id for c in got.calls] == [ep.calls[0].call_id, c2.call_id, c3.call_id]
    assert pool.episodes(min_version=1) and not pool.episodes(min_version=2)
    assert pool.episodes(max_version=8) and not pool.episodes(max_version=7)

    pool.update_episode(ep.episode_id, status=EpisodeStatus.FINISHED, reward=1.0, finished_at=123.0)
    pool.update_episode(ep.episode_id, reward_components={"x": 1.0}, interactions=[{"a": 1}], meta={"m": 2})
    got = pool.get_episode(ep.episode_id, with_calls=False)
    assert got.status is EpisodeStatus.FINISHED and got.reward == 1.0 and got.finished_at == 123.0
    assert got.reward_components == {"x": 1.0} and got.interactions == [{"a": 1}] and got.meta == {"m": 2}
    pool.update_episode(ep.episode_id, status="failed")  # None fields stay as they were
    got = pool.get_episode(ep.episode_id, with_calls=False)
    assert got.status is EpisodeStatus.FAILED and got.reward == 1.0

    with pytest.raises(DataPoolNotFoundError, match="not in the data pool"):
        pool.update_episode("missing", status="finished")
    with pytest.raises(DataPoolNotFoundError, match="put_episode it"):
        pool.add_call(make_call("missing"))
    with pytest.raises(InvalidRequestError, match="unknown episode status"):
        pool.update_episode(ep.episode_id, status="bogus")


def test_idempotent_double_write(pool):
    ep = make_episode(n_calls=3)
    pool.put_episode(ep)
    pool.put_episode(ep)
    ep.status = EpisodeStatus.FINISHED  # the episode row may change; its calls may not
    ep.reward = 1.0
    pool.put_episode(ep)
    with raw(pool) as conn:
        assert conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0] == 3
        assert conn.execute("SELECT COUNT(*) FROM episodes").fetchone()[0] == 1
    got = pool.get_episode(ep.episode_id)
    assert got.status is EpisodeStatus.FINISHED and got.reward == 1.0
    # Writing back what was read (float32-rounded logprobs) is also a no-op.
    pool.put_episode(got)
    assert pool.add_call(got.calls[1]) == 1
    # put_episode with fewer calls keeps the stored ones; new calls get the next seq.
    extra = make_call(ep.episode_id, n=2, seed=11)
    ep.calls = [extra]
    pool.put_episode(ep)
    assert [c.call_id for c in pool.calls(ep.episode_id)] == [c.call_id for c in got.calls] + [extra.call_id]


def test_conflict_is_typed_and_rolls_back(pool):
    ep = make_episode(n_calls=2)
    pool.put_episode(ep)
    changed = make_call(ep.episode_id, n=3, seed=0, call_id=ep.calls[0].call_id)
    changed.logprobs = [x + 0.5 for x in changed.logprobs]
    with pytest.raises(DataPoolConflictError, match="logprobs") as ei:
        pool.add_call(changed)
    assert isinstance(ei.value, ArborlError)
    assert_call_equal(pool.get_call(ep.calls[0].call_id), ep.calls[0])

    # A conflict inside put_episode rolls back the whole transaction (the row update too).
    bad = Episode(task_id="t0", episode_id=ep.episode_id, status=EpisodeStatus.FINISHED, reward=9.0)
    bad.calls = [make_call(ep.episode_id, n=2, seed=12), changed]
    with pytest.raises(DataPoolConflictError):
        pool.put_episode(bad)
    got = pool.get_episode(ep.episode_id)
    assert got.status is EpisodeStatus.RUNNING and got.reward is None
    assert [c.call_id for c in got.calls] == [c.call_id for c in ep.calls]

    # Same call id moved to another episode is a conflict too.
    other = make_episode(n_calls=0)
    pool.put_episode(other)
    moved = Call(**{**{f: getattr(ep.calls[1], f) for f in Call.__slots__}, "episode_id": other.episode_id})
    with pytest.raises(DataPoolConflictError, match="episode_id"):
        pool.add_call(moved)


def test_bad_records_write_nothing(pool):
    ep = make_episode(n_calls=2)
    ep.calls[1].logprobs = ep.calls[1].logprobs[:-1]
    with pytest.raises(InvalidRequestError, match="logprobs"):
        pool.put_episode(ep)
    assert pool.get_episode(ep.episode_id) is None and pool.count_episodes() == 0

    ep = make_episode(n_calls=1)
    ep.calls[0].prompt_token_ids = [1, 2**31]
    with pytest.raises(InvalidRequestError, match="int32"):
        pool.put_episode(ep)
    ep = make_episode(n_calls=1)
    ep.calls[0].completion_token_ids = [1.5, 2.0, 3.0]
    with pytest.raises(InvalidRequestError, match="integers"):
        pool.put_episode(ep)
    ep = make_episode(n_calls=1)
    ep.meta = {"obj": object()}
    with pytest.raises(InvalidRequestError, match="JSON"):
        pool.put_episode(ep)
    ep = make_episode(n_calls=1)
    ep.calls[0].episode_id = "someone-else"
    with pytest.raises(InvalidRequestError, match="belongs to episode"):
        pool.put_episode(ep)
    assert pool.count_episodes() == 0
    with raw(pool) as conn:
        assert conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0] == 0

    good = make_episode(n_calls=1)
    pool.put_episode(good)
    bad = make_call(good.episode_id, n=3)
    bad.versions = [0]
    with pytest.raises(InvalidRequestError, match="versions"):
        pool.add_call(bad)
    assert len(pool.calls(good.episode_id)) == 1


def test_queries(pool):
    eps = []
    for i in range(9):
        ep = make_episode(
            n_calls=1,
            version=i,
            task_id=f"t{i % 3}",
            group_id=f"g{i // 3}",
            status=[EpisodeStatus.RUNNING, EpisodeStatus.FINISHED, EpisodeStatus.FAILED][i % 3],
            started_at=1000.0 + i,
        )
        pool.put_episode(ep)
        eps.append(ep)
    ungrouped = make_episode(n_calls=0, started_at=2000.0, status=EpisodeStatus.ABORTED)
    pool.put_episode(ungrouped)

    ids = lambda xs: [e.episode_id for e in xs]  # noqa: E731
    assert ids(pool.episodes()) == ids(eps) + [ungrouped.episode_id]
    assert ids(pool.episodes(status=EpisodeStatus.FINISHED)) == ids(eps[1::3])
    assert ids(pool.episodes(status="failed")) == ids(eps[2::3])
    assert ids(pool.episodes(status=[EpisodeStatus.RUNNING, "failed"])) == ids(
        [e for i, e in enumerate(eps) if i % 3 != 1]
    )
    assert pool.episodes(status=[]) == []
    assert ids(pool.episodes(group_id="g1")) == ids(eps[3:6])
    assert ids(pool.episodes(task_id="t2", status="failed")) == ids(eps[2::3])
    # versions: episode i has tokens of versions i and i+1
    assert ids(pool.episodes(min_version=5)) == ids(eps[5:])
    assert ids(pool.episodes(max_version=3)) == ids(eps[:3])
    assert ids(pool.episodes(min_version=2, max_version=6)) == ids(eps[2:6])
    assert ids(pool.episodes(limit=2)) == ids(eps[:2])
    assert ids(pool.episodes(order="-started_at", limit=3)) == [ungrouped.episode_id] + ids(eps[8:6:-1])
    assert all(len(e.calls) == 1 for e in pool.episodes(group_id="g0"))
    assert all(e.calls == [] for e in pool.episodes(with_calls=False))
    with pytest.raises(InvalidRequestError, match="order"):
        pool.episodes(order="reward; DROP TABLE episodes")
    with pytest.raises(InvalidRequestError, match="status"):
        pool.episodes(status="done")

    assert pool.count_episodes() == 10
    assert pool.count_episodes(EpisodeStatus.FINISHED) == 3
    assert pool.count_episodes(["finished", "aborted"]) == 4
    assert pool.group_ids() == ["g0", "g1", "g2"]
    assert pool.group_ids(status="aborted") == []


def test_second_instance_sees_committed_data(tmp_path):
    path = tmp_path / "pool.sqlite"
    with DataPool(path) as a, DataPool(path) as b:
        ep = make_episode(n_calls=2)
        a.put_episode(ep)
        got = b.get_episode(ep.episode_id)
        assert got is not None and len(got.calls) == 2
        c = make_call(ep.episode_id, n=3, seed=7)
        b.add_call(c)
        b.update_episode(ep.episode_id, status="finished")
        got = a.get_episode(ep.episode_id)
        assert got.status is EpisodeStatus.FINISHED and got.calls[-1].call_id == c.call_id
        assert a.count_episodes("finished") == 1


def test_concurrent_writes_lose_nothing(tmp_path):
    path = tmp_path / "pool.sqlite"
    n_threads, per_thread = 8, 12
    with DataPool(path) as pool:
        shared = make_episode(n_calls=0)
        pool.put_episode(shared)
        errors: list[BaseException] = []
        written: list[list[Episode]] = [[] for _ in range(n_threads)]
        shared_calls: list[Call] = []
        start = threading.Barrier(n_threads)

        def worker(t: int) -> None:
            try:
                start.wait()
                for i in range(per_thread):
                    ep = make_episode(n_calls=2, version=t, group_id=f"g{t}")
                    pool.put_episode(ep)
                    written[t].append(ep)
                    c = make_call(shared.episode_id, n=2, seed=t * 100 + i)
                    pool.add_call(c)
                    shared_calls.append(c)
                    pool.update_episode(ep.episode_id, status="finished", reward=float(t))
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not errors, errors
        assert pool.count_episodes("finished") == n_threads * per_thread
        for t in range(n_threads):
            for ep in written[t]:
                got = pool.get_episode(ep.episode_id)
                assert got.reward == float(t)
                for g, w in zip(got.calls, ep.calls, strict=True):
                    assert_call_equal(g, w)
        got_shared = pool.calls(shared.episode_id)
        assert {c.call_id for c in got_shared} == {c.call_id for c in shared_calls}
        assert len(got_shared) == n_threads * per_thread
        with raw(pool) as conn:
            seqs = [r[0] for r in conn.execute(
                "SELECT seq FROM calls WHERE episode_id = ? ORDER BY seq", (shared.episode_id,))]
        assert seqs == list(range(n_threads * per_thread))
    # Also visible from a fresh instance.
    with DataPool(path) as again:
        assert again.count_episodes() == n_threads * per_thread + 1


def test_schema_version_and_bad_files(tmp_path):
    path = tmp_path / "pool.sqlite"
    DataPool(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(DataPoolSchemaError, match="schema version"):
        DataPool(path)

    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(DataPoolError, match="not a readable SQLite"):
        DataPool(junk)


def test_from_config_and_close(tmp_path):
    cfg = DataPoolConfig(filename="dp.sqlite", busy_timeout_s=1.5)
    pool = DataPool.from_config(tmp_path / "run", cfg)
    assert Path(pool.path) == tmp_path / "run" / "dp.sqlite" and pool.busy_timeout_s == 1.5
    pool.put_episode(make_episode(n_calls=1))
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(DataPoolError, match="closed"):
        pool.count_episodes()
    with DataPool.from_config(tmp_path / "run", cfg) as again:
        assert again.count_episodes() == 1


def test_crash_during_writes_keeps_every_committed_episode(tmp_path):
    """SIGKILL a writer mid-run: every episode it reported as committed is intact."""
    writer = _load_writer()
    path = tmp_path / "crash.sqlite"
    want_ids = 40
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(tmp_path),
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    reported: list[str] = []
    try:
        deadline = time.monotonic() + 30.0
        while len(reported) < want_ids:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"writer reported only {len(reported)} episodes in 30 s")
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                proc.wait(timeout=5)
                pytest.fail(f"writer exited early (rc={proc.returncode}): {proc.stderr.read()}")
            reported.append(line.strip())
            if len(reported) == 10:
                # A WAL reader in another process sees the writer's commits while it runs.
                with DataPool(path) as peek:
                    assert peek.get_episode(reported[0]) is not None
        assert proc.poll() is None, "writer should still be running when killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    # Lines printed before the kill were committed too; a torn last line (no newline) is not a report.
    reader.join(timeout=10)
    while True:
        item = lines.get_nowait() if not lines.empty() else None
        if item is None:
            break
        if item.endswith("\n"):
            reported.append(item.strip())
    proc.stdout.close()
    proc.stderr.close()
    assert len(reported) >= want_ids

    with DataPool(path) as pool:
        with raw(pool) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        for i, eid in enumerate(reported):
            assert eid == writer.episode_id(i)
            got = pool.get_episode(eid)
            assert got is not None, f"committed episode {eid} is missing"
            want = writer.make_episode(i)
            assert got.status is EpisodeStatus.FINISHED and got.reward == want.reward
            assert got.finished_at == want.finished_at and got.meta == want.meta
            assert got.interactions == want.interactions and got.reward_components == want.reward_components
            assert len(got.calls) == writer.N_CALLS
            for g, w in zip(got.calls, want.calls):
                assert_call_equal(g, w)
                assert g.logprobs == w.logprobs  # the writer uses exact float32 values
        # Whatever else made it in is whole: each stored call decodes consistently, and every
        # episode's version range matches its calls (the two are updated in one transaction).
        with raw(pool) as conn:
            for ep in pool.episodes():
                for c in ep.calls:
                    c.validate()
                vs = [v for c in ep.calls for v in c.versions]
                row = conn.execute(
                    "SELECT min_version, max_version FROM episodes WHERE episode_id = ?", (ep.episode_id,)
                ).fetchone()
                assert tuple(row) == ((min(vs), max(vs)) if vs else (None, None))
        # Still usable: a new write and read.
        fresh = make_episode(n_calls=2)
        pool.put_episode(fresh)
        got = pool.get_episode(fresh.episode_id)
        for g, w in zip(got.calls, fresh.calls, strict=True):
            assert_call_equal(g, w)


def test_trainer_logprobs_keyed_by_call_and_step(tmp_path):
    """The trainer's per-token log-probs of a call, float32 beside the immutable call: the latest
    step's read back; a (call, step) recorded again is replaced; a wrong count or an unknown call is a
    typed error that writes nothing; a version-1 file gains the table when opened."""
    path = tmp_path / "pool.sqlite"
    with DataPool(path) as pool:
        ep = Episode("t", "g", episode_id="e1")
        ep.calls = [make_call("e1", n=3, call_id="c1"), make_call("e1", n=2, seed=1, call_id="c2")]
        pool.put_episode(ep)
        pool.record_trainer_logprobs(0, {"c1": [-0.1, -0.2, -0.3], "c2": [-1.0, -2.0]})
        pool.record_trainer_logprobs(4, {"c1": [-0.5, -0.6, -0.7]})
        got = pool.trainer_logprobs(["c1", "c2", "nope"])
        assert got["c1"] == (4, pytest.approx([-0.5, -0.6, -0.7], rel=1e-7)) and set(got) == {"c1", "c2"}
        assert got["c2"][1] == [float(np.float32(x)) for x in (-1.0, -2.0)]
        pool.record_trainer_logprobs(4, {"c1": [-0.25, -0.5, -0.75]})
        assert pool.trainer_logprobs(["c1"])["c1"] == (4, [-0.25, -0.5, -0.75])
        with pytest.raises(InvalidRequestError, match="2 values for its 3 completion tokens"):
            pool.record_trainer_logprobs(5, {"c2": [-1.0, -1.0], "c1": [-1.0, -1.0]})
        with pytest.raises(DataPoolNotFoundError, match="call zz"):
            pool.record_trainer_logprobs(5, {"c2": [-1.0, -1.0], "zz": [-1.0]})
        assert pool.trainer_logprobs(["c2"])["c2"][0] == 0  # neither failed write left step 5
        with pytest.raises(InvalidRequestError, match="step"):
            pool.record_trainer_logprobs(-1, {})
    old = tmp_path / "v1.sqlite"  # what an arborl before the table wrote
    DataPool(old).close()
    conn = sqlite3.connect(old)
    conn.execute("DROP TABLE trainer_logprobs")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with DataPool(old) as pool:
        assert pool.setting("user_version") == SCHEMA_VERSION and pool.trainer_logprobs(["c1"]) == {}
