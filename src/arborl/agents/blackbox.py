"""Black-box agents (A2): any program that speaks the OpenAI API, run as a subprocess.

``BlackBoxRunner.run(command, task)`` opens a session on the gateway and starts ``command`` with

* ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``: the gateway's ``/v1`` and the session's key (so an
  unmodified ``openai`` client talks to the gateway and every call is recorded);
* ``OPENAI_MODEL``: the served model id; ``ARBORL_SESSION_ID``; ``ARBORL_TASK``: the task as JSON
  (``task_id``, ``prompt``, ``metadata``) -- or ``ARBORL_TASK_FILE``, a path to that JSON, when it is
  over 64 KiB; ``ARBORL_TASK_PROMPT`` when the prompt is text (and small).

The process runs in its own process group (session). At the timeout the group gets SIGTERM, then
SIGKILL after ``kill_grace_s``; when the main process exits, whatever it left running in its group
is killed too. stdout and stderr are kept (the last ``max_output_bytes`` of each) in the result, in
``episode.meta["blackbox"]`` (last 8 KiB) and, with ``log_dir``, in full files. The session ends
finished (exit 0), failed (other exit) or aborted (timeout), unless the agent finished it itself.

``BlackBoxRunner.attach(command, task, info)`` runs the program in a session opened by someone else
(``run_agent`` for the ``command`` agent, ``agents/command.py``) and leaves finishing it to them;
``env`` adds variables (the ``command`` agent passes the run's sampling parameters).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from arborl.gateway.sessions import SessionInfo
from arborl.types import EpisodeStatus, Task

if TYPE_CHECKING:
    from arborl.gateway.core import Gateway

_META_TAIL = 8192
_ENV_LIMIT = 64 * 1024  # bytes of task JSON passed in ARBORL_TASK; larger goes to ARBORL_TASK_FILE


@dataclass
class BlackBoxResult:
    episode_id: str
    status: EpisodeStatus
    returncode: int | None  # None: killed at the timeout before it exited
    timed_out: bool
    stdout: str
    stderr: str
    duration_s: float


class _Tail:
    """Keeps the last ``limit`` bytes of a stream (and optionally all of it in a file)."""

    def __init__(self, limit: int, path: Path | None) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.total = 0
        self.file = open(path, "wb") if path else None  # noqa: SIM115 - closed in close()

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        self.buf += data
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]
        if self.file:
            self.file.write(data)

    def close(self) -> None:
        if self.file:
            self.file.close()

    def text(self, limit: int | None = None) -> str:
        data = bytes(self.buf if limit is None else self.buf[-limit:])
        head = f"[... {self.total - len(data)} bytes dropped ...]\n" if self.total > len(data) else ""
        return head + data.decode("utf-8", "replace")


async def _pump(stream: asyncio.StreamReader | None, tail: _Tail) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        tail.feed(chunk)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class BlackBoxRunner:
    def __init__(
        self,
        gateway: Gateway,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        kill_grace_s: float = 5.0,
        max_output_bytes: int = 1 << 20,
        log_dir: str | Path | None = None,
    ) -> None:
        self.gateway = gateway
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.max_output_bytes = max_output_bytes
        self.log_dir = Path(log_dir) if log_dir else None

    async def run(
        self,
        command: Sequence[str] | str,
        task: Task,
        *,
        group_id: str = "",
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stitching: bool | None = None,
    ) -> BlackBoxResult:
        """Run one episode of ``command`` (argv list, or a shell string) on ``task``."""
        info = await self.gateway.create_session(task_id=task.task_id, group_id=group_id, agent_kind="blackbox",
                                                 stitching=stitching)
        return await self._in_session(command, task, info, cwd=cwd, env=env, timeout_s=timeout_s, finish=True)

    async def attach(
        self,
        command: Sequence[str] | str,
        task: Task,
        info: SessionInfo,
        *,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> BlackBoxResult:
        """Run ``command`` on ``task`` in the open session ``info`` without finishing it; the result's
        status is what the session should end with (or how the program itself ended it)."""
        return await self._in_session(command, task, info, cwd=cwd, env=env, timeout_s=timeout_s, finish=False)

    async def _in_session(self, command, task: Task, info: SessionInfo, *, cwd, env, timeout_s,
                          finish: bool) -> BlackBoxResult:
        sid = info.session_id
        full_env = {**os.environ, **(env or {})}
        full_env.update(
            OPENAI_BASE_URL=self.base_url,
            OPENAI_API_BASE=self.base_url,  # older clients read this name
            OPENAI_API_KEY=info.api_key,
            OPENAI_MODEL=self.gateway.model_name,
            ARBORL_SESSION_ID=sid,
        )
        task_json = json.dumps({"task_id": task.task_id, "prompt": task.prompt, "metadata": task.metadata}, default=str)
        task_file = None
        if len(task_json) <= _ENV_LIMIT:
            full_env["ARBORL_TASK"] = task_json
            if isinstance(task.prompt, str):
                full_env["ARBORL_TASK_PROMPT"] = task.prompt
        else:  # too big for one environment variable (Linux caps each at 128 KiB)
            fd, task_file = tempfile.mkstemp(prefix=f"arborl-task-{sid}-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(task_json)
            full_env["ARBORL_TASK_FILE"] = task_file
        paths = (None, None)
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            paths = (self.log_dir / f"{sid}.stdout", self.log_dir / f"{sid}.stderr")
        try:
            return await self._run(command, info, full_env, cwd, paths, timeout_s, finish)
        finally:
            if task_file:
                os.unlink(task_file)

    async def _run(self, command, info, full_env, cwd, paths, timeout_s, finish: bool) -> BlackBoxResult:
        sid = info.session_id
        out, err = _Tail(self.max_output_bytes, paths[0]), _Tail(self.max_output_bytes, paths[1])
        limit = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        kw = dict(stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                  cwd=str(cwd) if cwd else None, env=full_env, start_new_session=True)
        try:
            if isinstance(command, str):
                proc = await asyncio.create_subprocess_shell(command, **kw)
            else:
                proc = await asyncio.create_subprocess_exec(*command, **kw)
        except OSError as e:
            out.close()
            err.close()
            await self.gateway.set_meta(info.session, blackbox={"command": _shown(command), "error": str(e)})
            if finish:
                await self.gateway.finish(info.session, EpisodeStatus.FAILED)
            return BlackBoxResult(sid, EpisodeStatus.FAILED, None, False, "", f"cannot start {_shown(command)}: {e}", 0.0)
        pumps = asyncio.gather(_pump(proc.stdout, out), _pump(proc.stderr, err))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limit)
        except (asyncio.TimeoutError, TimeoutError):
            timed_out = True
            _killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.kill_grace_s)
            except (asyncio.TimeoutError, TimeoutError):
                pass
        finally:
            _killpg(proc.pid, signal.SIGKILL)  # the group: children it left behind, or a stubborn main process
            if proc.returncode is None:
                await proc.wait()
            try:
                await asyncio.wait_for(pumps, 10)  # a grandchild that left the group may hold the pipes
            except (asyncio.TimeoutError, TimeoutError):
                pumps.cancel()
            out.close()
            err.close()
        duration = time.perf_counter() - t0
        await self.gateway.settle(info.session)  # calls cut by the kill are aborted and recorded first
        code = None if timed_out else proc.returncode
        status = EpisodeStatus.ABORTED if timed_out else (EpisodeStatus.FINISHED if code == 0 else EpisodeStatus.FAILED)
        await self.gateway.set_meta(info.session, blackbox={
            "command": _shown(command), "returncode": code, "timed_out": timed_out, "duration_s": duration,
            "stdout_tail": out.text(_META_TAIL), "stderr_tail": err.text(_META_TAIL),
            "log_files": [str(p) for p in paths if p],
        })
        if finish and not info.session.finished:  # the agent may have finished (and chosen the status) itself
            await self.gateway.finish(info.session, status)
        if info.session.finished:
            status = info.session.episode.status
        return BlackBoxResult(sid, status, code, timed_out, out.text(), err.text(), duration)


def _shown(command: Sequence[str] | str) -> str:
    return command if isinstance(command, str) else " ".join(str(c) for c in command)
