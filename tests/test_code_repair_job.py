"""The code-repair job end to end (configs/code_repair.yaml's stages, on a tiny random model): demonstrations
of train tasks made by the scripted expert in the real bwrap sandbox, then one `arborl train` that
evaluates on eval and eval_perturbed, fine-tunes on the demos (train.sft), evaluates again, runs GRPO and
evaluates a third time; summary.json carries the three evaluations of both splits. ~1 min."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from arborl.config import load_config
from arborl.run.job import train
from arborl.run.sft import TranscriptError
from arborl.tasks.code_repair import CodeRepairSuite
from arborl.tasks.code_repair.demos import make_demos

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (make sandbox): the job runs in the bwrap sandbox")


def _cfg(tmp_path, *extra):
    return load_config(None, [
        "name=cr-job", f"runs_dir={tmp_path}", "model.source=tiny", "model.tiny_tokenizer=smollm2",
        "model.tiny_layers=1", "model.tiny_hidden=32", "engine.max_seq_len=2048", "scheduling.timeline=false",
        "rollout.task=code_repair", f"rollout.code_repair.suite_dir={tmp_path / 'suite'}",
        "rollout.code_repair.per_template=2", "rollout.code_repair.require_validated=false",
        "rollout.code_repair.tier=easy", "rollout.code_repair.eval_perturbed=true",
        f"rollout.envs.root_dir={tmp_path / 'ws'}", "rollout.envs.runtime=bwrap",
        "rollout.steps=1", "rollout.batch_tasks=1", "rollout.group_size=2", "rollout.max_tokens=8",
        "rollout.max_turns=3", "rollout.eval_tasks=1", "rollout.workers=0", "train.advantage.drop_zero_variance=false",
        "train.sft.batch_transcripts=2", "train.sft.heldout_fraction=0", *extra])


def test_one_train_runs_evals_sft_evals_rl_evals_and_keeps_them_in_the_summary(tmp_path):
    demos = tmp_path / "demos.jsonl"
    cfg = _cfg(tmp_path, f"train.sft.files=[{demos}]")
    with pytest.raises(TranscriptError, match="does not exist"):  # before the model loads, nothing written
        train(cfg)
    assert not cfg.run_dir.exists()

    suite = CodeRepairSuite(cfg.rollout.code_repair, envs=cfg.rollout.envs, max_turns=cfg.rollout.max_turns)
    report = asyncio.run(make_demos(suite, suite.tasks("train", 2, seed=0), per_task=1))
    assert len(report.demos) == 2 and not report.dropped  # the expert's path passes the hidden tests in bwrap
    demos.write_text("".join(json.dumps(d) + "\n" for d in report.demos))

    summary = train(cfg)
    stages = ("before", "after_sft", "after")
    for split in ("eval", "eval_perturbed"):
        for stage in stages:
            assert 0.0 <= summary[f"{split}_success_{stage}"] <= 1.0, (split, stage)
    assert summary["sft_transcripts"] == 2 and summary["sft_steps"] == 1 and summary["steps"] == 1
    on_disk = json.loads((cfg.run_dir / "summary.json").read_text())
    assert {k: on_disk[k] for k in summary if k.startswith("eval")} == {k: summary[k] for k in summary if k.startswith("eval")}

    # the order of the stages in metrics.jsonl: evals, SFT step, evals, RL step, evals
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    order = [(r["kind"], r.get("stage")) for r in rows if r["kind"] in ("sft", "step") or r.get("split")]
    assert order == [("eval", "before")] * 2 + [("sft", None)] + [("eval", "after_sft")] * 2 + [("step", None)] \
        + [("eval", "after")] * 2, order
    assert [r["split"] for r in rows if r.get("split")] == ["eval", "eval_perturbed"] * 3
    step = next(r for r in rows if r["kind"] == "step")
    assert step["episodes"] == 2 and step["policy_version"] == 2  # SFT published version 1, RL version 2

    # the policy after SFT, before RL, is kept as an HF directory that transformers loads: the fine-tuned
    # weights, not the start's
    from transformers import AutoModelForCausalLM

    from arborl.models import load_model

    sft_dir = cfg.run_dir / "checkpoint-sft"
    assert summary["sft_checkpoint"] == str(sft_dir)
    tuned = AutoModelForCausalLM.from_pretrained(sft_dir).state_dict()
    start = load_model(cfg.model).model.state_dict()
    assert tuned.keys() == start.keys() and any(not tuned[k].equal(start[k]) for k in tuned)

    # `arborl bench envs --quick` reads these figures from a recorded run of the job
    from rich.console import Console

    from arborl_bench.envs_episodes_bench import training_section

    figures = training_section(True, Console(quiet=True), run_dir=cfg.run_dir)
    assert figures["code_repair_success_before"] == summary["eval_success_before"]
    assert figures["code_repair_success_after_sft"] == summary["eval_success_after_sft"]
    assert figures["code_repair_success_after"] == summary["eval_success_after"]
    assert figures["code_repair_perturbed_success_after"] == summary["eval_perturbed_success_after"]
    assert str(cfg.run_dir) in figures["code_repair_source"]
    missing = training_section(True, Console(quiet=True), run_dir=tmp_path / "no-run")
    assert missing["code_repair_success_after"] is None and "make code-repair" in missing["code_repair_training"]
