"""An agent that holds a chosen episode open: the task suite's own agent which, when the episode numbered
``at`` (counted in its process, in the order episodes end) is done, writes a marker file and then waits
instead of returning -- once per install, however often its process is restarted. A fault injected
after the marker appears lands mid-step (that episode's group cannot finish) on any machine however
fast, in whatever process runs the episodes (a Ray rollout-worker actor on another node).

``install(dir, at)`` copies this file into ``dir`` with its settings beside it and returns the
``rollout.agent=...`` override; ``reached(dir)`` is the event."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

_ended = 0


def install(directory: Path, at: int) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    agent = directory / "hold_agent.py"
    shutil.copy(__file__, agent)
    agent.with_suffix(".json").write_text(json.dumps({"at": at}))
    return f"rollout.agent={agent}:hold_at"


def marker(directory: Path) -> Path:
    return directory / "hold_agent.reached"


def reached(directory: Path) -> bool:
    return marker(directory).exists()


def hold_at(suite, sampling):
    inner = suite.agent(sampling)
    here = Path(__file__)
    at = json.loads(here.with_suffix(".json").read_text())["at"]

    async def agent(task, client):
        global _ended
        outcome = await inner(task, client)
        _ended += 1
        if _ended == at:
            try:
                fd = os.open(here.with_suffix(".reached"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # once, across restarts
            except FileExistsError:
                return outcome
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            while True:  # held until the process dies (its node is removed)
                await asyncio.sleep(3600)
        return outcome

    return agent
