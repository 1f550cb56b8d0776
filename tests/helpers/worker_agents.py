"""White-box agents for the rollout-worker tests (loaded by path: rollout.agent=<this file>:<name>).

``slow``: one model call, then marks ``$ARBORL_TEST_MARKS/<pid>-<session>`` and, with
``$ARBORL_TEST_HOLD`` set, waits until ``$ARBORL_TEST_MARKS/release`` exists (so a test can kill its
worker mid-episode, whatever the machine's speed); answers its pid.
``crash``: raises (the agent's own failure); ``block``: blocks the worker's event loop (a stall)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from arborl.agents import AgentOutcome


def slow(suite, sampling):
    async def agent(task, client):
        await client.chat([{"role": "user", "content": str(task.prompt)}], **{**sampling, "max_tokens": 3})
        await client.interaction(kind="note", pid=os.getpid())
        (Path(os.environ["ARBORL_TEST_MARKS"]) / f"{os.getpid()}-{client.session_id}").touch()
        release = Path(os.environ["ARBORL_TEST_MARKS"]) / "release"
        deadline = time.monotonic() + 300
        while os.environ.get("ARBORL_TEST_HOLD") and not release.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return AgentOutcome(answer=str(os.getpid()), info={"pid": os.getpid()})
    return agent


def crash(suite, sampling):
    async def agent(task, client):
        await client.chat([{"role": "user", "content": "hi"}], **{**sampling, "max_tokens": 2})
        raise RuntimeError("the agent's own bug")
    return agent


def block(suite, sampling):
    async def agent(task, client):
        first = Path(os.environ["ARBORL_TEST_MARKS"]) / "blocked-once"
        if not first.exists():
            first.touch()
            time.sleep(600)  # blocks the worker's event loop: no more heartbeats
        await client.chat([{"role": "user", "content": "hi"}], **{**sampling, "max_tokens": 2})
        return AgentOutcome(answer="ok")
    return agent
