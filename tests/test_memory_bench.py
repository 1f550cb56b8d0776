"""bench memory's parts on a tiny model: every phase measured, the components counted, the lean settings
holding less than today's, and the LoRA step of the large-model part run whole (tiny shape)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arborl_bench import BENCHMARKS
from arborl_bench.memory_bench import CKPT, big_child, job_child, step_child, whole_job

REPO = Path(__file__).resolve().parents[1]

TINY = ["model.source=tiny", "model.tiny_tokenizer=none", "model.tiny_vocab=4096", "model.tiny_layers=2",
        "model.tiny_hidden=64", "engine.max_seq_len=320", "train.micro_batch_tokens=640", "train.logits_chunk_tokens=64"]


def test_the_jobs_phases_on_a_tiny_model():
    assert BENCHMARKS["memory"] == "arborl_bench.memory_bench:run"
    before, after = (job_child(v, True, TINY) for v in ("before", "after"))
    phases = ["rollout", "sft", "publish_sft", "rl_rollout", "rl_train", "rl_publish"]
    assert list(after["phases"]) == phases == list(before["phases"])
    for name in phases:
        assert after["phases"][name]["peak_gb"] > 0
    # the logits of a micro-batch: one chunk of train.logits_chunk_tokens rows, against all of them before
    assert after["logits_bytes_per_microbatch"] == 64 * 4096 * 4
    assert before["logits_bytes_per_microbatch"] == 640 * 4096 * 4
    comp = after["phases"]["rl_train"]["components_gb"]
    assert comp["engine_module"] < before["phases"]["rl_train"]["components_gb"]["engine_module"]
    assert comp["prefix_cache"] == 0 and before["phases"]["rl_train"]["components_gb"]["prefix_cache"] > 0
    assert after["phases"]["rl_train"]["components_gb"]["gradients"] < before["phases"]["rl_train"]["components_gb"]["gradients"]


def test_the_ckpt_variant_is_the_old_config_whatever_the_job_sets_now():
    from arborl.config import load_config

    now = load_config(str(REPO / "configs" / "code_repair.yaml"), []).train
    old = now.model_copy(update=CKPT)
    assert old.checkpoint_layers is True and old.micro_batch_tokens == 4096 and old.logits_chunk_tokens == 1024
    assert now.checkpoint_layers != old.checkpoint_layers  # the job's own differs: the variant measures a change


@pytest.mark.parametrize("kind", ["sft", "rl"])
def test_one_training_step_under_the_jobs_config_and_the_overrides_given(kind):
    out = step_child(kind, [*TINY, "train.activation_checkpointing=true", "train.sft.lr=1e-3"], transcripts_n=2)
    assert out["step"] == kind and out["seconds"] > 0
    assert out["peak_gb"] > 0.15  # a Python process with torch and a model
    assert out["peak_gb"] - out["peak_above_start_gb"] > 0.15  # above the start: the step's own
    with pytest.raises(SystemExit, match="sft or rl"):
        step_child("ppo", TINY)


def test_a_lora_grpo_step_of_a_small_shape_runs_whole():
    out = big_child(True, {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512}, (2, 48, 4))
    assert out["episodes"] == 2 and out["loss_tokens"] == 2 * 4 and out["finite_loss"]
    assert abs(out["step_s"] - (out["rollout_s"] + out["train_s"] + out["sync_s"])) <= 0.15
    assert out["peak_rss_gb"] >= out["step_peak_rss_gb"] > 0


def test_the_whole_job_is_run_as_a_user_runs_it_and_its_process_tree_measured(tmp_path):
    """bench memory's part 3 on a short calculator job: a real `arborl train` process, its tree's peak (a
    Python process with torch holds more than 150 MB) and its held-out figures; a run that fails, or a
    config whose SFT files are missing, is an error saying what to do."""
    short = ["model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
             "engine.max_seq_len=256", "rollout.steps=1", "rollout.batch_tasks=1", "rollout.group_size=2",
             "rollout.max_tokens=5", "rollout.eval_tasks=2", "report.curves=false"]
    out = whole_job(REPO / "configs/default.yaml", short, tmp_path)
    assert out["peak_rss_gb"] > 0.15 and out["wall_s"] > 0
    assert {"eval_success_before", "eval_success_after"} <= set(out["eval"])
    assert (tmp_path / "job" / "metrics.jsonl").is_file()
    with pytest.raises(RuntimeError, match="see .*bad.log"):
        whole_job(REPO / "configs/default.yaml", [*short, "rollout.task=no_such_task"], tmp_path, name="bad")
    with pytest.raises(FileNotFoundError, match="make code-repair-demos"):
        whole_job(REPO / "configs/default.yaml", [*short, f"train.sft.files=[{tmp_path}/none.jsonl]"], tmp_path)
