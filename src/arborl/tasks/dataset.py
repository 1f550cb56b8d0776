"""The ``dataset`` task suite: your prompts from files, scored by your reward function
(``rollout.task=dataset``, knobs ``rollout.data.*``).

* Tasks: the rows of ``rollout.data.train_files`` (``data_files.py``). Each training draw (one per
  step under ``sync``) is ``n`` rows sampled at random without replacement, seeded by the draw's
  seed, so a resumed run draws the same rows; when ``n`` exceeds the rows, whole shuffled passes
  are taken and repeated rows get ids ``<id>~1``, ``<id>~2``, ... (group ids stay unique).
  Evaluation takes the first ``n`` rows of ``rollout.data.eval_files`` (all of them when fewer).
* Agent: the built-in ``ReActAgent`` with no tools, ``rollout.data.system_prompt`` and
  ``rollout.max_turns`` (with no tools offered it returns after its first reply: single-turn).
  ``rollout.agent`` replaces it as for any suite.
* Score: ``rollout.data.reward_function`` (``reward_fn.py``) on the agent's final answer. It is
  called once when the suite is built, on the first training row with an empty completion and no
  calls, so a function that cannot run or returns no reward stops the job before training.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from arborl.agents import AgentLoop, AgentOutcome, ReActAgent
from arborl.tasks.data_files import DatasetError, load_tasks
from arborl.tasks.reward_fn import LoadedRewardFunction
from arborl.types import Call, Task

if TYPE_CHECKING:
    from arborl.config import DataConfig


class DatasetSuite:
    name = "dataset"

    def __init__(self, data: "DataConfig", *, max_turns: int = 1, eval_tasks: int = 0) -> None:
        if not data.train_files:
            raise DatasetError("rollout.task=dataset needs rollout.data.train_files: JSONL or Parquet files of prompts")
        if eval_tasks > 0 and not data.eval_files:
            raise DatasetError(f"rollout.eval_tasks={eval_tasks} evaluates on rollout.data.eval_files, which is empty: "
                               "give held-out files, or set rollout.eval_tasks=0")
        self.data = data
        self.max_turns = max_turns
        keys = dict(prompt_key=data.prompt_key, answer_key=data.answer_key)
        self.train = load_tasks(data.train_files, "train", knob="rollout.data.train_files", **keys)
        self.eval = load_tasks(data.eval_files, "eval", knob="rollout.data.eval_files", **keys) if data.eval_files else []
        self.reward = LoadedRewardFunction(data.reward_function)
        self._score(self.train[0], "", [])  # fail now, not after the first rollout

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if split == "eval":
            return [_copy(t) for t in self.eval[:n]]
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(seed)
        order: list[int] = []
        while len(order) < n:
            order += rng.sample(range(len(self.train)), min(n - len(order), len(self.train)))
        seen: dict[int, int] = {}
        out = []
        for i in order:
            k = seen[i] = seen.get(i, -1) + 1
            t = _copy(self.train[i])
            if k:
                t.task_id = f"{t.task_id}~{k}"
            out.append(t)
        return out

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        return ReActAgent([], system_prompt=self.data.system_prompt, max_turns=self.max_turns, **sampling)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        completion = outcome.answer if outcome is not None and outcome.answer is not None else ""
        return self._score(task, completion, calls)

    def _score(self, task: Task, completion: str, calls: list[Call]) -> dict[str, float]:
        answer = task.metadata.get(self.data.answer_key) if self.data.answer_key is not None else None
        return self.reward(task, completion, calls, answer)


def _copy(task: Task) -> Task:
    prompt = [dict(m) for m in task.prompt] if isinstance(task.prompt, list) else task.prompt
    return replace(task, prompt=prompt, metadata=dict(task.metadata))
