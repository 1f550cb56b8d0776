"""Records <-> rows of the data pool's tables: a Call or an Episode as the values its row stores
(validated, arrays and dicts encoded by :mod:`arborl.datapool.codec`), and rows back as records."""

from __future__ import annotations

import sqlite3
from typing import Any, Iterator, Sequence

from arborl.datapool import codec
from arborl.types import Call, Episode, EpisodeStatus, InvalidRequestError

IN_CHUNK = 500  # ids per IN (...) query, well under SQLite's variable limit


def chunks(items: Sequence[str], n: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def status_value(status: EpisodeStatus | str) -> str:
    try:
        return EpisodeStatus(status).value
    except ValueError:
        valid = ", ".join(s.value for s in EpisodeStatus)
        raise InvalidRequestError(f"unknown episode status {status!r}; valid: {valid}") from None


def opt_float(value: Any, what: str) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{what} must be a number or None, got {value!r}") from None


class EncodedCall:
    """A validated Call as its ``call_id`` and the immutable ``content`` of its row."""

    __slots__ = ("call_id", "content")

    def __init__(self, call: Call) -> None:
        if not isinstance(call, Call):
            raise InvalidRequestError(f"expected a Call, got {type(call).__name__}")
        call.validate()
        if not call.call_id or not isinstance(call.call_id, str):
            raise InvalidRequestError("call_id must be a non-empty string")
        if not call.episode_id or not isinstance(call.episode_id, str):
            raise InvalidRequestError(f"call {call.call_id}: episode_id must be a non-empty string")
        cid = call.call_id
        versions = list(call.versions)
        self.call_id = cid
        # Same order as schema.CALL_CONTENT.
        self.content: tuple[Any, ...] = (
            call.episode_id,
            str(call.engine_id),
            codec.encode_i32(call.prompt_token_ids, f"call {cid}: prompt_token_ids"),
            codec.encode_i32(call.completion_token_ids, f"call {cid}: completion_token_ids"),
            codec.encode_f32(call.logprobs, f"call {cid}: logprobs"),
            codec.encode_f32(call.sample_logprobs, f"call {cid}: sample_logprobs"),
            codec.encode_i32(versions, f"call {cid}: versions"),
            int(min(versions)) if versions else None,
            int(max(versions)) if versions else None,
            str(getattr(call.finish_reason, "value", call.finish_reason)),
            float(call.created_at),
            float(call.latency_s),
            int(call.cached_prompt_tokens),
            codec.encode_json(call.meta, f"call {cid}: meta"),
        )

    @property
    def episode_id(self) -> str:
        return self.content[0]


def episode_row(ep: Episode) -> tuple[Any, ...]:
    """The ``episodes`` row of ``ep`` from episode_id to finished_at (``put_episode``'s column order)."""
    eid = ep.episode_id
    return (
        eid,
        str(ep.task_id),
        str(ep.group_id),
        str(ep.agent_kind),
        status_value(ep.status),
        opt_float(ep.reward, f"episode {eid}: reward"),
        codec.encode_json(ep.reward_components, f"episode {eid}: reward_components"),
        codec.encode_json(ep.interactions, f"episode {eid}: interactions"),
        codec.encode_json(ep.meta, f"episode {eid}: meta"),
        float(ep.started_at),
        opt_float(ep.finished_at, f"episode {eid}: finished_at"),
    )


def row_to_call(row: sqlite3.Row) -> Call:
    """A ``calls`` row (any query selecting its columns by name) as a Call."""
    return Call(
        episode_id=row["episode_id"],
        prompt_token_ids=codec.decode_i32(row["prompt"]),
        completion_token_ids=codec.decode_i32(row["completion"]),
        logprobs=codec.decode_f32(row["logprobs"]),
        sample_logprobs=codec.decode_f32(row["sample_logprobs"]),
        versions=codec.decode_i32(row["versions"]),
        finish_reason=row["finish_reason"],
        call_id=row["call_id"],
        engine_id=row["engine_id"],
        created_at=row["created_at"],
        latency_s=row["latency_s"],
        cached_prompt_tokens=row["cached_prompt_tokens"],
        meta=codec.decode_json(row["meta"], {}),
    )


def row_to_episode(row: sqlite3.Row, calls: list[Call]) -> Episode:
    """An ``episodes`` row as an Episode with ``calls``."""
    return Episode(
        task_id=row["task_id"],
        group_id=row["group_id"],
        agent_kind=row["agent_kind"],
        status=EpisodeStatus(row["status"]),
        episode_id=row["episode_id"],
        calls=calls,
        interactions=codec.decode_json(row["interactions"], []),
        reward_components=codec.decode_json(row["reward_components"], {}),
        reward=row["reward"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        meta=codec.decode_json(row["meta"], {}),
    )


def read_trainer_logprobs(conn: sqlite3.Connection, call_ids: Sequence[str]) -> dict[str, tuple[int, list[float]]]:
    """``DataPool.trainer_logprobs`` on a connection of its own (the dashboard's read-only one)."""
    out: dict[str, tuple[int, list[float]]] = {}
    for chunk in chunks(list(dict.fromkeys(call_ids)), IN_CHUNK):
        for r in conn.execute(f"SELECT call_id, step, logprobs FROM trainer_logprobs WHERE call_id IN "
                              f"({', '.join('?' * len(chunk))}) ORDER BY step", list(chunk)):
            out[r["call_id"]] = (int(r["step"]), codec.decode_f32(r["logprobs"]))
    return out
