"""The `dataset` task suite: prompts from real JSONL / Parquet files read with Hugging Face datasets,
scored by a reward function given by path; every mistake is a typed error naming the file or knob."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from arborl.agents import ReActAgent
from arborl.agents.base import AgentOutcome
from arborl.config import ConfigError, DataConfig, RolloutConfig, load_config
from arborl.tasks import DatasetError, DatasetSuite, RewardFunctionError, make_suite

ROWS = [
    {"question": "Capital of France?", "answer": "Paris", "level": 1},
    {"question": "Capital of Japan?", "answer": "Tokyo", "level": 2},
    {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"}],
     "answer": "Lima", "level": 3},
]

REWARDS = '''
def length(task, completion, calls, answer):
    return float(len(completion))

def parts(task, completion, calls, answer):
    return {"outcome": 1.0 if completion == answer else 0.0, "level": task.metadata["level"]}

def seen(task, completion, calls, answer):
    return {"outcome": 0.0 if answer is None else 1.0}

def no_outcome(task, completion, calls, answer):
    return {"score": 1.0}

def nothing(task, completion, calls, answer):
    return None

def nan(task, completion, calls, answer):
    return float("nan")

def boom(task, completion, calls, answer):
    raise KeyError("gold")

def late(task, completion, calls, answer):
    return {"outcome": 1.0} if completion == "" else "oops"

not_a_function = 3
'''


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path):
    _jsonl(tmp_path / "train.jsonl", ROWS)
    _jsonl(tmp_path / "eval.jsonl", [{"question": f"Eval {i}?", "answer": str(i), "level": 0} for i in range(3)])
    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS))
    return tmp_path


def _data(tmp_path, **kw) -> DataConfig:
    base = dict(train_files=[str(tmp_path / "train.jsonl")], eval_files=[str(tmp_path / "eval.jsonl")],
                prompt_key="question", reward_function=f"{tmp_path}/rewards.py:parts")
    return DataConfig(**{**base, **kw})


def test_rows_become_tasks_with_their_columns_as_metadata(files):
    suite = DatasetSuite(_data(files), eval_tasks=2)
    tasks = suite.tasks("train", 3, seed=0)
    assert sorted(t.task_id for t in tasks) == ["data-train-0", "data-train-1", "data-train-2"]
    by_id = {t.task_id: t for t in tasks}
    assert by_id["data-train-0"].prompt == "Capital of France?"
    assert by_id["data-train-0"].metadata == {"answer": "Paris", "level": 1}
    assert by_id["data-train-2"].prompt == ROWS[2]["question"]  # chat messages pass through
    assert [t.task_id for t in suite.tasks("eval", 2)] == ["data-eval-0", "data-eval-1"]  # the first n, in order
    assert len(suite.tasks("eval", 64)) == 3  # all of them when fewer
    tasks[0].metadata["answer"] = "changed"  # a drawn task is a copy
    assert "changed" not in [t.metadata["answer"] for t in suite.tasks("train", 3, seed=0)]


def test_parquet_files_and_other_keys(files):
    import datasets

    rows = [{"text": f"Say {i}.", "gold": str(i), "extra": [i, i]} for i in range(4)]
    datasets.Dataset.from_list(rows).to_parquet(str(files / "train.parquet"))
    data = DataConfig(train_files=[str(files / "train.parquet")], prompt_key="text", answer_key="gold",
                      reward_function="exact_match")
    suite = DatasetSuite(data)
    (task,) = [t for t in suite.tasks("train", 4, seed=1) if t.prompt == "Say 2."]
    assert task.metadata == {"gold": "2", "extra": [2, 2]}
    # answer_key picks the column the reward function gets as `answer`
    assert suite.score(task, AgentOutcome(answer="2"), [])["outcome"] == 1.0
    assert suite.score(task, AgentOutcome(answer="3"), [])["outcome"] == 0.0


def test_draws_are_seeded_distinct_and_repeat_with_unique_ids(files):
    suite = DatasetSuite(_data(files))
    a, b = suite.tasks("train", 2, seed=5), suite.tasks("train", 2, seed=5)
    assert [t.task_id for t in a] == [t.task_id for t in b] and len({t.task_id for t in a}) == 2
    draws = {tuple(t.task_id for t in suite.tasks("train", 2, seed=s)) for s in range(20)}
    assert len(draws) > 1  # the seed changes the draw
    many = suite.tasks("train", 7, seed=0)
    ids = [t.task_id for t in many]
    assert len(set(ids)) == 7  # group ids stay unique
    assert sorted(i.split("~")[0] for i in ids).count("data-train-0") in (2, 3)
    assert {t.task_id for t in many[:3]} == {"data-train-0", "data-train-1", "data-train-2"}  # whole passes first


def test_agent_is_single_turn_react_with_the_system_prompt(files):
    suite = DatasetSuite(_data(files, system_prompt="Answer in one word."), max_turns=2)
    agent = suite.agent({"temperature": 0.5, "max_tokens": 7})
    assert isinstance(agent, ReActAgent) and not agent.tools
    assert agent.system_prompt == "Answer in one word." and agent.max_turns == 2
    assert agent.sampling == {"temperature": 0.5, "max_tokens": 7}
    assert DatasetSuite(_data(files)).agent({}).system_prompt is None


def test_reward_functions_by_path_and_built_in(files):
    task = DatasetSuite(_data(files)).tasks("train", 3)[0]
    length = DatasetSuite(_data(files, reward_function=f"{files}/rewards.py:length"))
    assert length.score(task, AgentOutcome(answer="abcd"), []) == {"outcome": 4.0}  # a float is the outcome
    assert length.score(task, None, []) == {"outcome": 0.0}  # no outcome: an empty completion
    parts = DatasetSuite(_data(files))
    assert parts.score(task, AgentOutcome(answer=task.metadata["answer"]), []) == {
        "outcome": 1.0, "level": float(task.metadata["level"])}
    exact = DatasetSuite(_data(files, reward_function="exact_match"))
    assert exact.score(task, AgentOutcome(answer=f"  {task.metadata['answer']}\n"), [])["outcome"] == 1.0
    assert exact.score(task, AgentOutcome(answer="no"), [])["outcome"] == 0.0
    no_answer = DatasetSuite(_data(files, answer_key=None, reward_function=f"{files}/rewards.py:seen"))
    assert no_answer.score(task, AgentOutcome(answer="x"), [])["outcome"] == 0.0  # answer_key=null: answer None
    assert DatasetSuite(_data(files, reward_function=f"{files}/rewards.py:seen")).score(task, None, [])["outcome"] == 1.0


@pytest.mark.parametrize("name,match", [
    ("no_outcome", r"rewards\.py:no_outcome on task data-train-0: the dict it returned has no 'outcome' \(keys: score\)"),
    ("nothing", r"rewards\.py:nothing on task data-train-0: it returned NoneType None; return a float"),
    ("nan", r"rewards\.py:nan on task data-train-0: the reward is nan, not a finite number"),
    ("boom", r"rewards\.py:boom raised on task data-train-0: KeyError\('gold'\)"),
])
def test_a_bad_reward_function_stops_the_suite_when_it_is_built(files, name, match):
    with pytest.raises(RewardFunctionError, match=match):
        DatasetSuite(_data(files, reward_function=f"{files}/rewards.py:{name}"))


def test_a_bad_return_value_later_is_a_typed_error_too(files):
    suite = DatasetSuite(_data(files, reward_function=f"{files}/rewards.py:late"))
    with pytest.raises(RewardFunctionError, match=r"late on task data-train-\d: it returned str 'oops'"):
        suite.score(suite.tasks("train", 1)[0], AgentOutcome(answer="hello"), [])


@pytest.mark.parametrize("spec,match", [
    ("{d}/rewards.py:missing", r"rollout\.data\.reward_function: .*has no attribute 'missing'"),
    ("{d}/nowhere.py:f", r"rollout\.data\.reward_function: .*does not exist"),
    ("{d}/rewards.py:not_a_function", r"rollout\.data\.reward_function: .*is a int, not a function"),
    ("exact_matc", r"rollout\.data\.reward_function: unknown reward function 'exact_matc'"),
])
def test_a_reward_function_that_does_not_resolve_names_the_knob(files, spec, match):
    with pytest.raises(DatasetError, match=match):
        DatasetSuite(_data(files, reward_function=spec.format(d=files)))


def test_file_errors_name_the_file_and_the_knob(files):
    t = files / "train.jsonl"
    cases = [
        (dict(train_files=[str(files / "missing.jsonl")]), rf"rollout\.data\.train_files: {files}/missing\.jsonl does not exist"),
        (dict(train_files=[str(files / "rewards.py")]), r"rewards\.py is not a \.jsonl, \.json or \.parquet file"),
        (dict(prompt_key="prompt"), rf"{t}: no column 'prompt' \(rollout\.data\.prompt_key\); its columns: question, answer, level"),
        (dict(answer_key="gold"), r"no column 'gold' \(rollout\.data\.answer_key\).*set rollout\.data\.answer_key=null"),
        (dict(train_files=[]), r"rollout\.task=dataset needs rollout\.data\.train_files"),
        (dict(eval_files=[str(files / "gone.jsonl")]), r"rollout\.data\.eval_files: .*gone\.jsonl does not exist"),
    ]
    for kw, match in cases:
        with pytest.raises(DatasetError, match=match):
            DatasetSuite(_data(files, **kw), eval_tasks=1)
    with pytest.raises(DatasetError, match=r"rollout\.eval_tasks=4 evaluates on rollout\.data\.eval_files, which is empty"):
        DatasetSuite(_data(files, eval_files=[]), eval_tasks=4)
    DatasetSuite(_data(files, eval_files=[]), eval_tasks=0)  # no evaluation: no eval files needed


def test_empty_malformed_and_bad_prompts(files):
    (files / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match=r"rollout\.data\.train_files: no rows in .*empty\.jsonl"):
        DatasetSuite(_data(files, train_files=[str(files / "empty.jsonl")]))
    (files / "broken.jsonl").write_text('{"question": "a", "answer": "b", "level": 1}\n{not json\n')
    with pytest.raises(DatasetError, match=r"cannot read .*broken\.jsonl as json"):
        DatasetSuite(_data(files, train_files=[str(files / "broken.jsonl")]))
    bad = [({"question": "", "answer": "a", "level": 1}, r"bad\.jsonl row 0: column 'question' is an empty string"),
           ({"question": [{"role": "robot", "content": "hi"}], "answer": "a", "level": 1}, r"row 0: question\[0\] has role 'robot'"),
           ({"question": [{"role": "user"}], "answer": "a", "level": 1}, r"question\[0\] needs a string 'content'"),
           ({"question": 7, "answer": "a", "level": 1}, r"must be a string or a non-empty list of chat messages, got int")]
    for row, match in bad:
        _jsonl(files / "bad.jsonl", [row])
        with pytest.raises(DatasetError, match=match):
            DatasetSuite(_data(files, train_files=[str(files / "bad.jsonl")]))
    assert issubclass(DatasetError, ConfigError)


def test_registered_as_dataset_and_built_from_the_rollout_section(files):
    rollout = RolloutConfig(task="dataset", max_turns=2, eval_tasks=1, data=_data(files))
    suite = make_suite(rollout)
    assert suite.name == "dataset" and suite.rollout is rollout and isinstance(suite.suite, DatasetSuite)
    assert suite.agent({}).max_turns == 2  # rollout.max_turns
    assert suite.train[0].task_id == "data-train-0"  # other attributes reach the suite


def test_eval_sample_chooses_which_rows_are_evaluated(files):
    # a held-out file that mixes two sources, the first one's rows first: the case
    rows = [{"question": f"{src} {i}?", "answer": str(i), "level": 0, "source": src}
            for src, count in (("gsm", 6), ("logic", 2)) for i in range(count)]
    _jsonl(files / "mixed.jsonl", rows)

    def chosen(**kw) -> list[str]:
        suite = DatasetSuite(_data(files, eval_files=[str(files / "mixed.jsonl")], **kw), eval_tasks=2)
        ids = [t.task_id for t in suite.tasks("eval", 2, seed=0)]
        assert [t.task_id for t in suite.tasks("eval", 2, seed=7)] == ids  # the same rows before and after training
        return ids

    def sources(ids: list[str]) -> list[str]:
        return [rows[int(i.rsplit("-", 1)[1])]["source"] for i in ids]

    first = chosen()
    assert first == chosen(eval_sample="first") == ["data-eval-0", "data-eval-1"]
    assert sources(first) == ["gsm", "gsm"]  # only the first source

    random_0, random_1 = chosen(eval_sample="random"), chosen(eval_sample="random", eval_seed=1)
    assert random_0 != first and random_1 != random_0  # a sample, and the seed says which
    assert chosen(eval_sample="random") == random_0

    stratified = chosen(eval_sample="stratified", eval_stratify_key="source")
    assert sorted(sources(stratified)) == ["gsm", "logic"]  # one row of each source
    suite = DatasetSuite(_data(files, eval_files=[str(files / "mixed.jsonl")], eval_sample="stratified",
                              eval_stratify_key="source"), eval_tasks=4)
    assert sorted(sources([t.task_id for t in suite.tasks("eval", 4)])) == ["gsm", "gsm", "gsm", "logic"]  # 6:2 -> 3:1
    assert len(suite.tasks("eval", 100)) == len(rows)

    with pytest.raises(ConfigError, match=r"rollout\.data: eval_sample=stratified needs eval_stratify_key, the column"):
        load_config(None, ["rollout.data.eval_sample=stratified"])
    with pytest.raises(DatasetError, match=r"rollout\.data\.eval_stratify_key: 3 of 3 rows of .*eval\.jsonl have no "
                                           r"column 'source' \(first: data-eval-0\)"):
        DatasetSuite(_data(files, eval_sample="stratified", eval_stratify_key="source"), eval_tasks=1)
