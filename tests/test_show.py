"""`arborl show RUN_DIR`: a step's generations decoded with the run's tokenizer, with task ids and rewards,
from the data pool."""

from __future__ import annotations

from helpers.tiny_run import tiny_cfg
from transformers import AutoTokenizer
from typer.testing import CliRunner

from arborl.cli import app
from arborl.dashboard.pool import buckets
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.show import transcript
from arborl.types import Call, Episode


def test_show_prints_a_steps_generations_with_rewards(tmp_path):
    cfg = tiny_cfg(tmp_path, "shown", "rollout.steps=2", "rollout.max_turns=1")
    train(cfg)
    runner = CliRunner()
    out = runner.invoke(app, ["show", str(cfg.run_dir), "--step", "1", "--n", "3"])
    assert out.exit_code == 0, out.output
    text = out.stdout
    assert text.startswith(f"step 1 of {cfg.run_dir}: 3 episode(s)")
    tokenizer = AutoTokenizer.from_pretrained(cfg.run_dir / "checkpoint")
    headers = [line for line in text.splitlines() if line.startswith("--- task ")]
    assert len(headers) == 3
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(h.rsplit("episode ", 1)[1]) for h in headers]
    assert len({e.task_id for e in episodes}) == 3  # one from each group first
    for header, e in zip(headers, episodes):
        assert e.group_id == f"step0:{e.task_id}"  # step 1 trains draw 0
        assert header.startswith(f"--- task {e.task_id}  reward {e.reward:.3f}  (outcome {e.reward_components['outcome']:.3g}")
        assert f"  model: {tokenizer.decode(e.calls[0].completion_token_ids)}" in text
    last = runner.invoke(app, ["show", str(cfg.run_dir), "--n", "1"])  # the last step by default
    assert last.exit_code == 0 and last.stdout.startswith(f"step 2 of {cfg.run_dir}: 1 episode(s)")
    assert "step1:" in last.stdout
    missing = runner.invoke(app, ["show", str(cfg.run_dir), "--step", "7"])
    assert missing.exit_code == 2 and "step 7 trained no episodes" in missing.output and "steps that trained: 1-2" in missing.output


def test_show_of_an_async_run_shows_what_the_step_trained_not_its_draw(tmp_path):
    cfg = tiny_cfg(tmp_path, "async", "rollout.steps=3", "scheduling.consume=async_ratio", "scheduling.async_ratio=1")
    train(cfg)
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        led = pool.ledger()
    for step in (1, 2, 3):
        trained = {t["episode_id"] for t in led["trainings"] if t["step"] == step}
        out = CliRunner().invoke(app, ["show", str(cfg.run_dir), "--step", str(step), "--n", "100"])
        assert out.exit_code == 0, out.output
        shown = {line.rsplit("episode ", 1)[1] for line in out.stdout.splitlines() if line.startswith("--- task ")}
        assert shown == trained and len(shown) == 16
    # the dashboard's trajectory browser files each group under the step that trained it, too
    got = {b["bucket"]: {g["group_id"] for g in b["groups"]} for b in buckets(cfg.run_dir / "datapool.sqlite")}
    for step in (1, 2, 3):
        assert got[f"step {step}"] == {t["group_id"] for t in led["trainings"] if t["step"] == step}


def test_a_multi_turn_transcript_shows_what_the_environment_added():
    def call(prompt, completion):
        return Call("ep", prompt, completion, [0.0] * len(completion), [0.0] * len(completion), [0] * len(completion), "stop")

    episode = Episode("t", "step0:t", calls=[call([1, 2], [3, 4]), call([1, 2, 3, 4, 5, 6], [7]), call([9], [8])])
    assert transcript(episode, None) == [
        "  prompt: 1 2", "  model: 3 4", "  env: 5 6", "  model: 7",
        "  prompt (not extending the previous call): 9", "  model: 8",
    ]
