"""What a task suite gives the rollout controller: tasks, the agent that attempts them, the score."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from arborl.agents import AgentLoop, AgentOutcome
from arborl.types import Call, Task

if TYPE_CHECKING:
    from arborl.config import RolloutConfig


class TaskSuite(Protocol):
    name: str

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        """``n`` tasks of ``split`` ("train" or "eval"), deterministic for a seed; splits are disjoint."""

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        """The white-box agent that attempts a task; ``sampling`` holds the OpenAI sampling params."""

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        """Reward components of one finished episode; ``"outcome"`` is the task's success in [0, 1]."""


class SuiteFactory(Protocol):
    """What ``rollout.task`` names: the rollout section -> a task suite."""

    def __call__(self, rollout: "RolloutConfig") -> TaskSuite: ...


class ConfiguredSuite:
    """A task suite together with the rollout section it was built from (what ``make_suite`` returns).

    It serves the protocol by delegating to ``suite`` (other attributes too), and gives agent
    factories, which receive the run's suite, the knobs they read: ``suite.rollout``."""

    def __init__(self, suite: TaskSuite, rollout: "RolloutConfig") -> None:
        self.suite = suite
        self.rollout = rollout

    @property
    def name(self) -> str:
        return self.suite.name

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        return self.suite.tasks(split, n, seed)

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        return self.suite.agent(sampling)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        return self.suite.score(task, outcome, calls)

    def shutdown(self) -> None:
        """Stop what the suite started for the run (a subprocess, a server): its ``shutdown()``, where it
        has one (suites with nothing to stop have none)."""
        shutdown = getattr(self.suite, "shutdown", None)
        if callable(shutdown):
            shutdown()

    def __getattr__(self, attr: str) -> Any:
        if attr in ("suite", "rollout"):  # not set yet (copy, pickle): never recurse
            raise AttributeError(attr)
        return getattr(self.suite, attr)
