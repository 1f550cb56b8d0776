"""The agent layer: white-box loops (``AgentLoop``, ``run_agent``, ``ReActAgent``) and black-box
programs (``BlackBoxRunner``; the ``command`` agent runs one per episode), both recorded through the gateway."""

from arborl.agents.base import AGENTS, AgentFactory, AgentLoop, AgentOutcome, EpisodeRun, run_agent
from arborl.agents.blackbox import BlackBoxResult, BlackBoxRunner
from arborl.agents.client import ChatReply, SessionClient
from arborl.agents.command import CommandAgent
from arborl.agents.react import ReActAgent, Tool, task_messages

__all__ = [
    "AGENTS",
    "AgentFactory",
    "AgentLoop",
    "AgentOutcome",
    "BlackBoxResult",
    "BlackBoxRunner",
    "ChatReply",
    "CommandAgent",
    "EpisodeRun",
    "ReActAgent",
    "SessionClient",
    "Tool",
    "run_agent",
    "task_messages",
]
