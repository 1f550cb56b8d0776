"""A task suite for the judge tests (rollout.task=<this file>:suite): every episode passes its
"tests" (outcome 1) and offers the judge its answer as the change."""

from arborl.tasks.arith import ArithSuite


class JudgedSuite(ArithSuite):
    name = "judged"

    def score(self, task, outcome, calls):
        return {"outcome": 1.0}

    def judge_input(self, task, outcome):
        return f"Solve: {task.prompt}", f"+ answer = {outcome.answer!r}"


def suite(rollout):
    return JudgedSuite()
