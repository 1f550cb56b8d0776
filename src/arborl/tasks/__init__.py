"""Built-in task suites, picked by name (``rollout.task``)."""

from __future__ import annotations

from arborl.tasks.base import TaskSuite


def get_suite(name: str, **options) -> TaskSuite:
    if name == "calculator":
        from arborl.tasks.calculator import CalculatorSuite

        return CalculatorSuite(**options)
    if name == "arith":
        from arborl.tasks.arith import ArithSuite

        return ArithSuite(**options)
    if name == "even_tokens":
        from arborl.tasks.toy import EvenTokensSuite

        return EvenTokensSuite()
    raise KeyError(f"unknown task suite {name!r}; choose calculator, arith or even_tokens")


__all__ = ["TaskSuite", "get_suite"]
