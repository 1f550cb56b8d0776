"""The ``dataset`` task suite: your prompts from files, scored by your reward function
(``rollout.task=dataset``, knobs ``rollout.data.*``).

* Tasks: the rows of ``rollout.data.train_files`` (``data_files.py``). Each training draw (one per
  step under ``sync``) is ``n`` rows sampled at random without replacement, seeded by the draw's
  seed, so a resumed run draws the same rows; when ``n`` exceeds the rows, whole shuffled passes
  are taken and repeated rows get ids ``<id>~1``, ``<id>~2``, ... (group ids stay unique).
  Evaluation takes ``n`` rows of ``rollout.data.eval_files`` (all of them when fewer), chosen by
  ``rollout.data.eval_sample``: the first ``n``; a random sample (``eval_seed``); or stratified by the
  column ``eval_stratify_key``, each of its values getting its share of the ``n`` rows (largest
  remainder; at least one each while ``n`` allows), sampled with ``eval_seed``. The same ``n`` rows
  every time, so before and after training compare; they keep their order in the files.
* Agent: the built-in ``ReActAgent`` with no tools, ``rollout.data.system_prompt`` and
  ``rollout.max_turns`` (with no tools offered it returns after its first reply: single-turn).
  ``rollout.agent`` replaces it as for any suite.
* Score: ``rollout.data.reward_function`` (``reward_fn.py``) on the agent's final answer. It is
  called once when the suite is built, on the first training row with an empty completion and no
  calls, so a function that cannot run or returns no reward stops the job before training.
"""

from __future__ import annotations

import json
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
        if data.eval_sample == "stratified":
            key = data.eval_stratify_key
            missing = [t.task_id for t in self.eval if key not in t.metadata]
            if missing:
                raise DatasetError(f"rollout.data.eval_stratify_key: {len(missing)} of {len(self.eval)} rows of "
                                   f"{', '.join(data.eval_files)} have no column {key!r} (first: {missing[0]})")
        self.reward = LoadedRewardFunction(data.reward_function)
        self._score(self.train[0], "", [])  # fail now, not after the first rollout

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if split == "eval":  # the same rows whatever the seed: evaluations compare
            return [copy_task(self.eval[i]) for i in eval_rows(self.eval, n, self.data)]
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return draw_rows(self.train, n, seed)

    def agent(self, sampling: dict[str, Any]) -> AgentLoop:
        return ReActAgent([], system_prompt=self.data.system_prompt, max_turns=self.max_turns, **sampling)

    def score(self, task: Task, outcome: AgentOutcome | None, calls: list[Call]) -> dict[str, float]:
        completion = outcome.answer if outcome is not None and outcome.answer is not None else ""
        return self._score(task, completion, calls)

    def _score(self, task: Task, completion: str, calls: list[Call]) -> dict[str, float]:
        answer = task.metadata.get(self.data.answer_key) if self.data.answer_key is not None else None
        return self.reward(task, completion, calls, answer)


def draw_rows(rows: list[Task], n: int, seed: int) -> list[Task]:
    """``n`` copies of ``rows`` sampled without replacement (seeded); when ``n`` exceeds the rows, whole
    shuffled passes, repeated rows getting ids ``<id>~1``, ``<id>~2``, ..."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < n:
        order += rng.sample(range(len(rows)), min(n - len(order), len(rows)))
    seen: dict[int, int] = {}
    out = []
    for i in order:
        k = seen[i] = seen.get(i, -1) + 1
        t = copy_task(rows[i])
        if k:
            t.task_id = f"{t.task_id}~{k}"
        out.append(t)
    return out


def eval_rows(rows: list[Task], n: int, data: "DataConfig") -> list[int]:
    """Indices of the ``n`` eval rows ``data.eval_sample`` chooses, in file order."""
    n = min(n, len(rows))
    if data.eval_sample == "first":
        return list(range(n))
    rng = random.Random(data.eval_seed)
    if data.eval_sample == "random":
        return sorted(rng.sample(range(len(rows)), n))
    strata: dict[str, list[int]] = {}  # column value -> its rows, in order of first appearance
    for i, t in enumerate(rows):
        strata.setdefault(json.dumps(t.metadata[data.eval_stratify_key], sort_keys=True, default=str), []).append(i)
    sizes = [len(v) for v in strata.values()]
    quota = [1] * len(sizes) if n >= len(sizes) else [0] * len(sizes)
    left, room = n - sum(quota), [s - q for s, q in zip(sizes, quota)]
    if left:  # largest remainder over what each stratum has left
        exact = [left * r / sum(room) for r in room]
        extra = [int(x) for x in exact]
        by_remainder = sorted(range(len(sizes)), key=lambda j: (-(exact[j] - extra[j]), j))
        for j in by_remainder[: left - sum(extra)]:
            extra[j] += 1
        quota = [q + e for q, e in zip(quota, extra)]
    return sorted(i for members, q in zip(strata.values(), quota) for i in rng.sample(members, q))


def copy_task(task: Task) -> Task:
    prompt = [dict(m) for m in task.prompt] if isinstance(task.prompt, list) else task.prompt
    return replace(task, prompt=prompt, metadata=dict(task.metadata))
