"""examples/capitals through configs/dataset.yaml: a real `arborl train` (tiny model) on the example's
JSONL prompts, scored by the example's reward file; the data pool holds what the files and the reward say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arborl.config import load_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.models import load_model
from arborl.registry import load_object

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=256", "scheduling.timeline=false"]


def _rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (REPO / "examples/capitals" / name).read_text().splitlines()]


def _text(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def test_the_dataset_example_trains_on_its_prompts_scored_by_its_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's paths are its folder's (configs/): it runs from any folder
    cfg = load_config(REPO / "configs/dataset.yaml", [
        f"runs_dir={tmp_path}", *TINY, "rollout.steps=2", "rollout.batch_tasks=2", "rollout.group_size=2",
        "rollout.max_tokens=6", "rollout.eval_tasks=1", "train.lr=0.05"])
    summary = train(cfg)
    assert summary["steps"] == 2
    reward = load_object(f"{REPO}/examples/capitals/reward.py:reward")
    train_rows, eval_rows = _rows("train.jsonl"), _rows("eval.jsonl")
    tokenizer = load_model(cfg.model).tokenizer
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(e.episode_id) for e in pool.episodes()]
    trained = [e for e in episodes if e.group_id.startswith("step")]
    evaluated = [e for e in episodes if e.group_id.startswith("eval")]
    assert len(trained) == 2 * 2 * 2 and len(evaluated) == 2  # 2 steps x 2 tasks x 2; 1 eval task, twice
    for e in episodes:
        rows = train_rows if e.group_id.startswith("step") else eval_rows
        row = rows[int(e.task_id.split("-")[2].split("~")[0])]  # data-<split>-<row>
        (call,) = e.calls  # single-turn
        prompt = tokenizer.decode(call.prompt_token_ids)
        assert _text(row["prompt"]) in prompt and "Answer with the name of the city only." in prompt
        completion = e.meta["outcome"]["answer"] or ""
        expected = reward(None, completion, e.calls, row["answer"])
        assert e.reward_components == expected and e.reward == expected["outcome"]
    assert {"outcome", "correct", "brief"} == set(trained[0].reward_components)
    steps = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert any(s.get("samples", 0) > 0 for s in steps if s["kind"] == "step")  # the reward varied: it trained


@pytest.mark.parametrize("bad", ["rollout.data.train_files=[examples/capitals/missing.jsonl]",
                                 "rollout.data.prompt_key=question"])
def test_a_bad_data_knob_stops_the_job_with_the_file_named(tmp_path, monkeypatch, bad):
    from arborl.tasks import DatasetError

    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "configs/dataset.yaml", [f"runs_dir={tmp_path}", *TINY, bad])
    with pytest.raises(DatasetError, match=r"examples/capitals/(missing|train)\.jsonl"):
        train(cfg)
