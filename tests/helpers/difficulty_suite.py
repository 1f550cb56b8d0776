"""A task suite for the dynamic-sampling tests (rollout.task=<this file>:suite): one call per episode;
tasks named easy-* always pass, hard-* never, mixed-* pass when the first generated token is even (so a
sampled group usually has both)."""

from arborl.tasks.arith import ArithSuite
from arborl.types import Task


class DifficultySuite(ArithSuite):
    name = "difficulty"

    def tasks(self, split, n, seed=0):
        kinds = ["easy", "hard", "mixed"]
        return [Task(task_id=f"{kinds[(seed + i) % 3]}-{(seed + i) % 6}", prompt="Say a word.", split=split)
                for i in range(n)]

    def score(self, task, outcome, calls):
        kind = task.task_id.split("-")[0]
        if kind == "easy":
            return {"outcome": 1.0}
        if kind == "hard" or not calls or not calls[0].completion_token_ids:
            return {"outcome": 0.0}
        return {"outcome": float(calls[0].completion_token_ids[0] % 2 == 0)}


def suite(rollout):
    return DifficultySuite()
