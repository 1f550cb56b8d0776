"""Curriculum by a task attribute (scheduling.curriculum*): the train stream starts with the easiest value and
unlocks the next every curriculum_steps steps; a stream with none of the unlocked values is a typed error."""

from __future__ import annotations

import json

import pytest

from arborl.config import load_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.scheduling.curriculum import Curriculum, CurriculumError


def test_stages_unlock_one_value_every_steps_draws_and_unlisted_values_come_last():
    c = Curriculum("tier", ["easy", "medium"], steps=3)
    assert [c.stage(d) for d in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert c.admits({"tier": "easy"}, 0) and not c.admits({"tier": "medium"}, 2) and c.admits({"tier": "medium"}, 3)
    assert not c.admits({"tier": "hard"}, 5) and c.admits({"tier": "hard"}, 6) and c.admits({}, 6)
    assert c.skipped == 2 and c.unlocked(4) == ["easy", "medium"]
    assert Curriculum("level", [1, 2], steps=1).admits({"level": 1}, 0)  # values compare as text


def _cfg(tmp_path, name: str, *extra: str):
    rows = [{"question": f"Say {w}.", "answer": w, "level": lvl}
            for lvl, words in (("easy", ["yes", "no", "ok"]), ("hard", ["maybe", "never", "always"])) for w in words]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(  # rewards that differ within a group, so every step trains and publishes
        "def odd(task, completion, calls, answer):\n    return float(len(completion) % 2)\n")
    return load_config(None, [
        f"name={name}", f"runs_dir={tmp_path}", "seed=5",
        "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=256", "rollout.task=dataset", f"rollout.data.train_files=[{data}]",
        "rollout.data.prompt_key=question", f"rollout.data.reward_function={tmp_path}/rewards.py:odd",
        "rollout.batch_tasks=3", "rollout.group_size=2", "rollout.max_tokens=4",
        "rollout.eval_tasks=0", "rollout.steps=4", "rollout.max_idle_steps=10", *extra,
    ])


def _levels_by_step(cfg) -> dict[int, set[str]]:
    """The levels of the tasks each training step ran (sync: step k's tokens carry policy version k)."""
    level = {f"data-train-{i}": lvl for i, lvl in enumerate(["easy"] * 3 + ["hard"] * 3)}
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = pool.episodes(with_calls=True)
    out: dict[int, set[str]] = {}
    for e in episodes:
        out.setdefault(e.min_version(), set()).add(level[e.task_id.split("~")[0]])
    return out


def test_a_run_draws_only_unlocked_levels_and_reports_its_stage(tmp_path):
    cfg = _cfg(tmp_path, "curriculum", "scheduling.curriculum_key=level", "scheduling.curriculum=easy,hard",
               "scheduling.curriculum_steps=2")
    train(cfg)
    levels = _levels_by_step(cfg)
    assert levels[0] == levels[1] == {"easy"}
    assert "hard" in levels[2] | levels[3]
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["sched/curriculum_stage"] for r in steps] == [0, 0, 1, 1]
    assert steps[-1]["sched/curriculum_skipped"] > 0

    off = _cfg(tmp_path, "no-curriculum", "rollout.steps=2")
    train(off)
    assert "hard" in _levels_by_step(off)[0] | _levels_by_step(off)[1]  # the knob is what kept them out


def test_a_curriculum_no_task_satisfies_is_a_typed_error_naming_the_knob(tmp_path):
    cfg = _cfg(tmp_path, "unsatisfiable", "scheduling.curriculum_key=level", "scheduling.curriculum=medium",
               "rollout.steps=1")
    with pytest.raises(CurriculumError, match="scheduling.curriculum"):
        train(cfg)
