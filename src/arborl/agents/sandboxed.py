"""A black-box program as the agent of an episode, run *inside* the episode's sandbox.

``SandboxedCommand(argv, runtime=..., workspace=...)`` runs any program that speaks OpenAI through
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` in the episode's workspace (its cwd). The sandbox has no
network: the gateway's Unix socket is bound in and a small forwarder (``envs/gateway_proxy.py``)
serves it on the sandbox's own loopback, so the program's shell commands, file edits and model calls
all happen in the sandbox while every model call is recorded by the gateway like any other.

The program gets the same environment as the ``command`` agent (``agents/command.py``): the session's
key, ``OPENAI_MODEL``, ``ARBORL_SESSION_ID``, ``ARBORL_TASK`` (JSON) and ``ARBORL_SAMPLING`` (JSON).
Its answer is its stdout; exit 0 is finished, another code failed, the time limit aborted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from arborl.agents.base import AgentOutcome
from arborl.envs.base import Runtime, Workspace
from arborl.envs.gateway_proxy import proxy_argv
from arborl.types import EpisodeStatus, Task

_TAIL = 2000


def _from_here(arg: str, *, program: bool) -> str:
    """A relative path to a file here (``.venv/bin/python``, ``examples/agent.py``) as an absolute one: the
    sandbox's working directory is the workspace, so it would not be found there; its directory must be bound
    in (rollout.envs.ro_binds; the running interpreter's is). A bare program name is left to PATH, and links
    are kept, not resolved: a venv's python finds its packages through the path it was started by."""
    path = Path(arg)
    if path.is_absolute() or not path.is_file() or (program and "/" not in arg):
        return arg
    return str(path.absolute())


class SandboxedCommand:
    def __init__(self, command: Sequence[str], *, runtime: Runtime, workspace: Workspace,
                 sampling: dict[str, Any] | None = None, timeout_s: float = 600.0, python: str | None = None) -> None:
        self.command = [_from_here(c, program=i == 0) for i, c in enumerate(command)]
        self.runtime = runtime
        self.workspace = workspace
        self.sampling = dict(sampling or {})
        self.timeout_s = timeout_s
        self.python = python or sys.executable  # bound read-only into the sandbox (rollout.envs.bind_python)

    async def __call__(self, task: Task, client: Any) -> AgentOutcome:
        env = {
            "OPENAI_API_KEY": client.api_key,
            "OPENAI_MODEL": client.model,
            "ARBORL_SESSION_ID": client.session_id,
            "ARBORL_TASK": json.dumps({"task_id": task.task_id, "prompt": task.prompt}, default=str),
            "ARBORL_SAMPLING": json.dumps(self.sampling),
        }
        async with client.gateway_socket() as sock:
            res = await self.runtime.run(self.workspace, proxy_argv(self.python, sock, self.command), env=env,
                                         timeout_s=self.timeout_s, unix_sockets=[sock])
        status = (EpisodeStatus.ABORTED if res.timed_out
                  else EpisodeStatus.FINISHED if res.returncode == 0 else EpisodeStatus.FAILED)
        info = {"returncode": res.returncode, "timed_out": res.timed_out, "killed": res.killed,
                "stderr_tail": res.stderr[-_TAIL:], "duration_s": res.duration_s}
        return AgentOutcome(answer=res.stdout.strip() or None, status=status, info=info)
