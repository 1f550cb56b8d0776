"""One rollout worker process: ``python -m arborl.workers.main``.

Protocol, one JSON object per line: the pool writes to the worker's stdin

    {"kind": "init", "rollout": {...the rollout config...}, "base_url": "http://.../v1", "model": "..."}
    {"kind": "episode", "job_id": "...", "task": {...}, "session_id": "...", "api_key": "...", "harness_key": "...",
     "sampling": {...}}
    {"kind": "cancel", "job_id": "..."}

and reads from its stdout ``{"kind": "ready"}``, ``{"kind": "beat"}`` every ``BEAT_S`` seconds while its
event loop runs, and one ``{"kind": "result", "job_id": ..., ...}`` per episode. The agent's own
prints go to stderr, never into the protocol. The worker exits when its stdin closes.

Each episode runs the configured agent (``rollout.agent`` for the suite ``rollout.task``) with an
``HttpSessionClient`` on the episode's session; the controller opened the session and closes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any, TextIO

import httpx

BEAT_S = 0.5


class _Out:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def send(self, **msg: Any) -> None:
        self.stream.write(json.dumps(msg, default=str) + "\n")
        self.stream.flush()


async def _lines(stream) -> "asyncio.StreamReader":
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stream)
    return reader


async def _episode(job: dict[str, Any], ctx: dict[str, Any], out: _Out) -> None:
    from arborl.agents.http_client import GatewayHTTPError, HttpSessionClient
    from arborl.envs.base import InfraError
    from arborl.types import EpisodeStatus, Task

    client = HttpSessionClient(ctx["base_url"], job["session_id"], job["api_key"], ctx["model"], http=ctx["http"],
                               unix_socket=ctx["unix_socket"], harness_key=job.get("harness_key"))
    result: dict[str, Any] = {"job_id": job["job_id"]}
    try:
        agent = ctx["factory"](ctx["suite"], job["sampling"])
        outcome = await agent(Task(**job["task"]), client)
        status = outcome.status if outcome is not None else EpisodeStatus.FINISHED
        result.update(status=EpisodeStatus(status).value, answer=outcome.answer if outcome else None,
                      info=outcome.info if outcome else {})
    except asyncio.CancelledError:
        result.update(status="aborted", error="cancelled by the controller")
    except (InfraError, GatewayHTTPError) as e:
        if isinstance(e, GatewayHTTPError) and not e.retryable:
            result.update(status="failed", error=str(e))
        else:
            result.update(status="failed", error=f"{type(e).__name__}: {e}", infra_error=str(e))
    except Exception as e:  # noqa: BLE001 - the agent's failure is the episode's, reported, not the worker's
        result.update(status="failed", error="".join(traceback.format_exception_only(type(e), e)).strip(),
                      traceback=traceback.format_exc()[-4000:])
    out.send(kind="result", **result)


async def serve(stdin, out: _Out) -> None:
    from arborl.agents import AGENTS
    from arborl.config import RolloutConfig
    from arborl.tasks import make_suite

    reader = await _lines(stdin)
    line = await reader.readline()
    if not line:
        return
    init = json.loads(line)
    rollout = RolloutConfig.model_validate(init["rollout"])
    async with httpx.AsyncClient(timeout=None) as http:
        ctx = {"base_url": init["base_url"], "model": init["model"], "http": http, "unix_socket": init.get("unix_socket"),
               "suite": make_suite(rollout), "factory": AGENTS.get(rollout.agent)}
        running: dict[str, asyncio.Task] = {}

        async def beat() -> None:
            while True:
                out.send(kind="beat")
                await asyncio.sleep(BEAT_S)

        beats = asyncio.create_task(beat())
        out.send(kind="ready", pid=os.getpid())
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                if msg["kind"] == "episode":
                    t = asyncio.create_task(_episode(msg, ctx, out))
                    running[msg["job_id"]] = t
                    t.add_done_callback(lambda _t, j=msg["job_id"]: running.pop(j, None))
                elif msg["kind"] == "cancel" and msg["job_id"] in running:
                    running[msg["job_id"]].cancel()
        finally:
            beats.cancel()
            for t in running.values():
                t.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the agent prints goes to stderr, not into the protocol
    asyncio.run(serve(sys.stdin, _Out(proto)))


if __name__ == "__main__":
    main()
