"""A white-box agent for the run-lifecycle tests: the task suite's own agent which, when the episode
numbered ``at`` (counted in its process, in the order episodes end) is done and before it returns,
sends ``signal`` (TERM, KILL, ...) to its own process -- once per install, however often the process
is restarted. A stop or a crash lands inside a chosen step, with that episode still open, at the same
point on any machine however fast, and in whatever process runs the episodes (the job's, or a Ray
trainer actor's, which inherits no environment from the test).

``install(dir, signal, at)`` copies this file into ``dir`` with its settings beside it and returns
the ``rollout.agent=...`` override."""

from __future__ import annotations

import json
import os
import shutil
import signal as _signal
from pathlib import Path

_ended = 0


def install(directory: Path, signal: str, at: int, *, not_pid: int | None = None, target: str = "self") -> str:
    """``not_pid``: a process the signal must never hit (the test's own); the episode fails instead.
    ``target="rank"``: the signal goes to the last trainer rank process (train.parallel) this process
    started, not to this process."""
    directory.mkdir(parents=True, exist_ok=True)
    agent = directory / "signal_agent.py"
    shutil.copy(__file__, agent)
    agent.with_suffix(".json").write_text(json.dumps({"signal": signal, "at": at, "not_pid": not_pid, "target": target}))
    return f"rollout.agent={agent}:signal_at"


def fired(directory: Path) -> bool:
    return (directory / "signal_agent.fired").exists()


def signal_at(suite, sampling):
    inner = suite.agent(sampling)
    here = Path(__file__)
    settings = json.loads(here.with_suffix(".json").read_text())
    marker = here.with_suffix(".fired")

    async def agent(task, client):
        global _ended
        outcome = await inner(task, client)
        _ended += 1
        if _ended == settings["at"]:
            if os.getpid() == settings.get("not_pid"):
                raise RuntimeError("signal_agent: the episodes run in the test's own process")
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # once, across restarts
            except FileExistsError:
                return outcome
            os.close(fd)
            pid = _last_rank() if settings.get("target") == "rank" else os.getpid()
            os.kill(pid, getattr(_signal, "SIG" + settings["signal"]))
        return outcome

    return agent


def _last_rank() -> int:
    """The highest-numbered ``arborl.train.ranks`` child of this process, else (cluster.backend=ray, the
    ranks are Ray actors) the newest Ray rank actor process."""
    ranks, actors = {}, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"arborl.train.ranks" in cmd:
            rank = [e for e in env.split(b"\0") if e.startswith(b"RANK=")]
            ranks[int(rank[0][5:])] = int(entry)
        elif b"ray::RankActor" in cmd:
            actors.append(int(entry))
    if ranks:
        return ranks[max(ranks)]
    if actors:
        return max(actors)
    raise RuntimeError("signal_agent: no trainer rank process to signal")
