"""bench memory's parts on a tiny model: every phase measured, the components counted, the lean settings
holding less than today's, and the LoRA step of the large-model part run whole (tiny shape)."""

from __future__ import annotations

from arborl_bench import BENCHMARKS
from arborl_bench.memory_bench import big_child, job_child

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


def test_a_lora_grpo_step_of_a_small_shape_runs_whole():
    out = big_child(True, {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512}, (2, 48, 4))
    assert out["episodes"] == 2 and out["loss_tokens"] == 2 * 4 and out["finite_loss"]
    assert abs(out["step_s"] - (out["rollout_s"] + out["train_s"] + out["sync_s"])) <= 0.15
    assert out["peak_rss_gb"] >= out["step_peak_rss_gb"] > 0
