"""White-box agents (A1): an agent is an async function of a task and a session-bound client.

    async def my_agent(task: Task, client: SessionClient) -> AgentOutcome: ...

``run_agent`` opens a session (one episode in the data pool), runs the loop with a timeout and
closes the session: finished when the loop returns, failed when it raises (the error is kept on
the episode, the calls recorded so far stay), aborted on timeout. The agent's model calls go
through ``client`` and so through the gateway's one recording path.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from arborl.agents.client import SessionClient
from arborl.envs.base import InfraError
from arborl.gateway.errors import GatewayError
from arborl.registry import Registry
from arborl.types import Call, EpisodeStatus, Task

if TYPE_CHECKING:
    from arborl.gateway.core import Gateway


@dataclass
class AgentOutcome:
    """What an agent loop returns; environments score ``answer`` (and read ``info``)."""

    answer: str | None = None
    status: EpisodeStatus = EpisodeStatus.FINISHED
    info: dict[str, Any] = field(default_factory=dict)


class AgentLoop(Protocol):
    async def __call__(self, task: Task, client: SessionClient) -> AgentOutcome | None: ...


class AgentFactory(Protocol):
    """What ``rollout.agent`` names: (the run's task suite, the episode's OpenAI sampling params) ->
    the agent loop of one episode."""

    def __call__(self, suite: Any, sampling: dict[str, Any]) -> AgentLoop: ...


AGENTS: Registry[AgentFactory] = Registry("agent")


@AGENTS.register("suite")
def suite_agent(suite: Any, sampling: dict[str, Any]) -> AgentLoop:
    """The task suite's own agent (``suite.agent(sampling)``)."""
    return suite.agent(sampling)


@dataclass
class EpisodeRun:
    """One episode an agent ran: where it is stored and how it ended."""

    episode_id: str
    status: EpisodeStatus
    outcome: AgentOutcome | None
    error: str | None
    duration_s: float
    infra: bool = False  # it failed for an infrastructure reason (``InfraError``): retried, never trained on


async def run_agent(
    gateway: Gateway,
    agent: AgentLoop,
    task: Task,
    *,
    group_id: str = "",
    timeout_s: float | None = None,
    stitching: bool | None = None,
    metadata: dict[str, Any] | None = None,
    replay: list[Call] | None = None,
) -> EpisodeRun:
    """Run ``agent`` on ``task`` in a fresh white-box session; never raises for the agent's errors.
    ``replay``: the recorded calls of an interrupted run of this episode, served again from the record
    while the agent asks the same prompts (``Gateway.create_session``)."""
    info = await gateway.create_session(
        task_id=task.task_id, group_id=group_id, agent_kind="whitebox", stitching=stitching, metadata=metadata,
        replay=replay,
    )
    client = SessionClient(gateway, info)
    t0 = time.perf_counter()
    outcome: AgentOutcome | None = None
    error: str | None = None
    infra = False
    try:
        outcome = await asyncio.wait_for(agent(task, client), timeout_s)
        status = outcome.status if outcome is not None else EpisodeStatus.FINISHED
    except (asyncio.TimeoutError, TimeoutError):
        status, error = EpisodeStatus.ABORTED, f"the agent exceeded its timeout of {timeout_s} s"
    except InfraError as e:
        status, error, infra = EpisodeStatus.FAILED, f"infrastructure failure: {e}", True
    except Exception as e:  # noqa: BLE001 - the episode fails, the rollout goes on
        status = EpisodeStatus.FAILED
        error = "".join(traceback.format_exception_only(type(e), e)).strip()
        infra = isinstance(e, GatewayError) and e.status >= 500  # the gateway or an engine failed, not the agent
        tb = traceback.format_exc()
        await gateway.set_meta(info.session, agent_traceback=tb[-4000:])
    duration = time.perf_counter() - t0
    await gateway.settle(info.session)  # abandoned calls (timeout, error) are aborted and recorded first
    await gateway.set_meta(
        info.session,
        outcome={"answer": outcome.answer if outcome else None, "info": outcome.info if outcome else {},
                 "error": error, "duration_s": duration},
        **({"infra_error": error} if infra else {}),
    )
    await gateway.finish(info.session, status)
    return EpisodeRun(info.session_id, status, outcome, error, duration, infra)
