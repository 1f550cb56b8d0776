"""The ``command`` agent (``rollout.agent=command``, A2; X2: mini-swe-agent runs so): every episode runs the black-box program
``rollout.agent_command`` (an argv list) once, with ``BlackBoxRunner.attach`` in the episode's session.

The program gets the environment of ``agents/blackbox.py`` -- ``OPENAI_BASE_URL`` (the run's gateway,
served over HTTP on the job's own event loop by ``agents/served.py``), ``OPENAI_API_KEY`` (the
episode session's key), ``OPENAI_MODEL``, ``ARBORL_SESSION_ID``, ``ARBORL_TASK`` -- and
``ARBORL_SAMPLING``: the episode's sampling parameters as JSON (``temperature``, ``top_p``,
``max_tokens``, ``seed``). The program should send them with its model calls: the trainer optimises
the policy at ``rollout.temperature``, so episodes sampled otherwise are off-policy.

Its outcome: ``answer`` is what it printed on stdout, stripped (what the task suite scores; log to
stderr); status finished (exit 0), failed (another exit code, or it cannot start) or aborted (killed
at ``rollout.agent_timeout_s``), or the status it gave its session itself (``POST .../finish``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from arborl.agents.base import AGENTS, AgentOutcome
from arborl.agents.blackbox import BlackBoxRunner
from arborl.agents.client import SessionClient
from arborl.agents.served import serve_http
from arborl.config import ConfigError
from arborl.gateway.sessions import SessionInfo
from arborl.types import Task

_INFO_TAIL = 2000  # characters of stderr kept in the outcome's info


class CommandAgent:
    """``await CommandAgent(["python", "agent.py"], sampling={...})(task, client)`` -> AgentOutcome."""

    def __init__(self, command: Sequence[str], *, sampling: dict[str, Any] | None = None,
                 timeout_s: float = 600.0) -> None:
        self.command = list(command)
        self.sampling = dict(sampling or {})
        self.timeout_s = timeout_s

    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome:
        env = {"ARBORL_SAMPLING": json.dumps(self.sampling)}
        async with serve_http(client.gateway) as base_url:
            runner = BlackBoxRunner(client.gateway, base_url, timeout_s=self.timeout_s)
            res = await runner.attach(self.command, task, SessionInfo(client.session, client.api_key), env=env)
        info = {"returncode": res.returncode, "timed_out": res.timed_out, "stderr_tail": res.stderr[-_INFO_TAIL:]}
        return AgentOutcome(answer=res.stdout.strip() or None, status=res.status, info=info)


@AGENTS.register("command")
def command_agent(suite: Any, sampling: dict[str, Any]) -> Any:
    """The program ``suite.rollout.agent_command`` (``make_suite`` gives every suite its rollout section);
    on the host, or, for a suite that offers ``command_agent`` (code_repair), in the episode's sandbox."""
    rollout = getattr(suite, "rollout", None)
    command = list(getattr(rollout, "agent_command", None) or [])
    if rollout is None or not command:
        raise ConfigError("rollout.agent=command needs rollout.agent_command (the program's argv) and a suite built "
                          "by arborl.tasks.make_suite, which carries the rollout section")
    if hasattr(suite, "command_agent"):  # a suite with environments runs the program inside the episode's sandbox
        return suite.command_agent(command, sampling, rollout.agent_timeout_s)
    return CommandAgent(command, sampling=sampling, timeout_s=rollout.agent_timeout_s)
