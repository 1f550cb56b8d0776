"""Task suites, by name (``rollout.task``): the built-in ``calculator``, ``arith`` and ``even_tokens``,
or a user's own as ``package.module:attr`` / ``path/to/file.py:attr``.

A registry entry is a factory ``(rollout: RolloutConfig) -> TaskSuite`` (a suite class whose
constructor takes the rollout section works too); the ``TaskSuite`` protocol (``tasks/base.py``) is
three methods: ``tasks(split, n, seed)``, ``agent(sampling)`` and ``score(task, outcome, calls)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arborl.registry import Registry
from arborl.tasks.arith import ArithSuite
from arborl.tasks.base import SuiteFactory, TaskSuite
from arborl.tasks.calculator import CalculatorSuite
from arborl.tasks.toy import EvenTokensSuite

if TYPE_CHECKING:
    from arborl.config import RolloutConfig

TASK_SUITES: Registry[SuiteFactory] = Registry("task suite")


@TASK_SUITES.register("calculator")
def _calculator(rollout: "RolloutConfig") -> CalculatorSuite:
    return CalculatorSuite(in_context_example=rollout.in_context_example, max_turns=rollout.max_turns)


@TASK_SUITES.register("arith")
def _arith(rollout: "RolloutConfig") -> ArithSuite:
    return ArithSuite()


@TASK_SUITES.register("even_tokens")
def _even_tokens(rollout: "RolloutConfig") -> EvenTokensSuite:
    return EvenTokensSuite()


def make_suite(rollout: "RolloutConfig") -> TaskSuite:
    """The task suite ``rollout.task`` names, built from the rollout section."""
    return TASK_SUITES.get(rollout.task)(rollout)


__all__ = ["TASK_SUITES", "SuiteFactory", "TaskSuite", "make_suite"]
