"""What a request in flight (``gateway/run.py``) needs from the gateway, and nothing more: where its
engine requests go (the engine pool), how tokens become text, how a served call is recorded, the
counters, and a place to run the detached finaliser that records it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arborl.datapool import DataPool
from arborl.engine.pool import EnginePool
from arborl.gateway.errors import BadRequestError, GatewayError

if TYPE_CHECKING:
    from arborl.gateway.openai_format import ServedChoice
    from arborl.gateway.sessions import Session
    from arborl.gateway.stitching import CallRecord


@dataclass
class GatewayStats:
    requests: int = 0
    calls_recorded: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    aborted: int = 0
    stitched: int = 0
    drift_events: int = 0
    replayed_tokens: int = 0  # completion tokens served from a record (a resumed episode), not decoded
    started_at: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        """Counters are bumped from several threads (event loops, recording workers)."""
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def count_error(self, e: GatewayError) -> None:
        self.add("errors_5xx" if e.status >= 500 else "errors_4xx", 1)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("requests", "calls_recorded", "errors_4xx", "errors_5xx", "aborted",
                                              "stitched", "drift_events", "replayed_tokens")}


class TextCodec:
    """Token ids <-> text with the model's tokenizer (None: a model served by token ids only)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def decode_raw(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode_one(self, t: int) -> str:
        """One token as shown in log-probs (``<id>`` without a tokenizer)."""
        return self.decode_raw([t]) if self.tokenizer is not None else f"<{t}>"

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequestError("this model has no tokenizer: send token ids (prompt_token_ids, or a list of ints as prompt)")
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []


class RequestContext:
    """The gateway as a request sees it."""

    def __init__(self, engines: EnginePool, datapool: DataPool, text: TextCodec, *, eos_ids: frozenset[int],
                 model_name: str, stats: GatewayStats) -> None:
        self.engines = engines
        self.datapool = datapool
        self.text = text
        self.eos_ids = eos_ids
        self.model_name = model_name
        self.stats = stats
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run ``coro`` detached from its caller (a client that goes away cannot cancel it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait until every request started on this event loop is recorded (or failed)."""
        loop = asyncio.get_running_loop()
        while True:
            mine = [t for t in list(self._tasks) if t.get_loop() is loop and not t.done()]
            if not mine:
                return
            await asyncio.gather(*mine, return_exceptions=True)

    def record(self, session: "Session", served: "list[ServedChoice]", records: "list[CallRecord | None]") -> None:
        """Store the calls (worker thread), then make them stitchable. Raises on a data-pool error."""
        for c in served:
            self.datapool.add_call(c.call)
        with session.lock:
            for c, rec in zip(served, records):
                session.calls += 1
                session.last_call_id = c.call.call_id
                if rec is not None and not session.finished:
                    session.history.add(rec)
        self.stats.add("calls_recorded", len(served))
