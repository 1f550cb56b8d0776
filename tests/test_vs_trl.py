"""`arborl bench vs-trl`: both frameworks get the same tasks, prompt token ids, reward and
hyper-parameters; the timing hooks on TRL still fit the installed TRL (skipped without trl)."""

from __future__ import annotations

import math

import pytest

from arborl.agents.react import task_messages
from arborl_bench import get_benchmark
from arborl_bench.vs_trl_bench import (
    Workload,
    arborl_config,
    paired_ratio,
    step_tasks,
    summarize,
    trl_args,
    trl_dataset_rows,
)
from arborl.config import ModelConfig
from arborl.gateway.render import ChatRenderer, normalize_messages
from arborl.models import load_model
from arborl_bench.vs_trl_bench import trl_reward
from arborl.config import RolloutConfig
from arborl.tasks import arith, make_suite


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2", tiny_layers=1, tiny_hidden=16))


def test_registered():
    assert get_benchmark("vs-trl").__module__ == "arborl_bench.vs_trl_bench"
    assert make_suite(RolloutConfig(task="arith")).name == "arith"


def test_arith_tasks_deterministic_and_splits_disjoint():
    a, b = arith.make_tasks("train", 40, seed=5), arith.make_tasks("train", 40, seed=5)
    assert [t.prompt for t in a] == [t.prompt for t in b]
    ev = arith.make_tasks("eval", 40, seed=5)
    assert [t.prompt for t in a] != [t.prompt for t in ev]
    assert {t.metadata["level"] for t in a} == {1, 2, 3}
    with pytest.raises(ValueError):
        arith.make_tasks("test", 2)


def test_reward_is_one_rule_for_both_frameworks():
    task = arith.make_tasks("train", 1)[0]
    ans = task.metadata["answer"]
    suite = arith.ArithSuite()
    from arborl.agents import AgentOutcome

    for text, want in [(f"Answer: {ans}", 1.0), (f"Answer: {int(ans) + 1}", 0.0), (ans, 0.0), ("", 0.0)]:
        assert arith.reward(ans, text) == want
        assert suite.score(task, AgentOutcome(answer=text), [])["outcome"] == want  # arborl
        assert trl_reward([[{"role": "assistant", "content": text}]], [ans]) == [want]  # TRL, conversational
    assert suite.score(task, None, [])["outcome"] == 0.0


def test_same_messages_and_prompt_token_ids(tiny):
    """arborl's agent sends task_messages(task, SYSTEM_PROMPT) and its gateway renders them;
    TRL renders the dataset's prompt with apply_chat_template(tokenize=True): same ids."""
    tok = tiny.tokenizer
    renderer = ChatRenderer(tok)
    wl = Workload(steps=2)
    rows = trl_dataset_rows(wl)
    tasks = [t for k in range(wl.steps) for t in step_tasks(wl, k)]
    assert len(rows) == len(tasks) == wl.steps * wl.batch_tasks
    for row, task in zip(rows, tasks):
        arborl_msgs = task_messages(task, arith.SYSTEM_PROMPT)
        assert row["prompt"] == arborl_msgs and row["task_id"] == task.task_id
        arborl_ids = renderer.encode(renderer.render(normalize_messages(arborl_msgs), None, add_generation_prompt=True))
        trl_ids = tok.apply_chat_template([row["prompt"]], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"][0]
        assert list(trl_ids) == arborl_ids


def test_step_tasks_are_what_the_controller_draws():
    from arborl.run.controller import draw_tasks

    wl = Workload(steps=3)
    for k in range(wl.steps):  # the controller's task stream: draw k is what synchronous step k trains on
        want = draw_tasks(arith.ArithSuite(), wl.seed, wl.batch_tasks, k)
        assert [t.task_id for t in step_tasks(wl, k)] == [t.task_id for t in want]
        rows = trl_dataset_rows(wl)[k * wl.batch_tasks:(k + 1) * wl.batch_tasks]
        assert [r["task_id"] for r in rows] == [t.task_id for t in want]


def test_same_hyperparameters(tmp_path):
    wl = Workload()
    cfg = arborl_config(wl, str(tmp_path))
    args = trl_args(wl, str(tmp_path / "trl"))
    r, t = cfg.rollout, cfg.train
    assert args["num_generations"] == r.group_size == wl.group_size
    assert args["per_device_train_batch_size"] == r.batch_tasks * r.group_size
    assert args["max_completion_length"] == r.max_tokens and r.max_turns == 1
    assert args["temperature"] == r.temperature and args["top_p"] == r.top_p == 1.0 and args["top_k"] == 0
    assert args["learning_rate"] == t.lr and args["lr_scheduler_type"] == "constant"
    assert args["max_grad_norm"] == t.grad_clip and args["weight_decay"] == t.weight_decay == 0.0
    assert (args["adam_beta1"], args["adam_beta2"]) == tuple(t.betas) and args["adam_epsilon"] == t.adam_eps
    assert args["epsilon"] == t.loss.settings["clip_low"] and args["epsilon_high"] == t.loss.settings["clip_high"]
    assert args["beta"] == t.loss.kl_coef == 0.0
    assert args["loss_type"] == "dapo" and t.loss.aggregation == "token_mean"
    assert args["scale_rewards"] == "group" and t.advantage.std_normalize
    assert not t.advantage.drop_zero_variance  # both train on every sample
    assert args["num_iterations"] == 1 and t.old_logprobs == "trainer"
    assert not args["shuffle_dataset"] and not args["bf16"] and cfg.model.dtype == "float32"


def test_ratios():
    assert paired_ratio([1.0, 2.0, 3.0], [2.0, 4.0, 3.0]) == 0.5
    assert paired_ratio([], []) is None
    a = [{"step_s": 2.0, "generate_s": 1.0, "train_s": 1.0}, {"step_s": 4.0, "generate_s": 1.0, "train_s": 3.0}]
    t = [{"step_s": 8.0, "generate_s": 2.0, "train_s": 6.0}, {"step_s": 8.0, "generate_s": 4.0, "train_s": 4.0}]
    s = summarize(a, t)
    assert s["arborl_step_s"] == 3.0 and s["trl_step_s"] == 8.0
    assert s["ratio_step"] == 0.375 and s["ratio_generate"] == 0.375 and s["ratio_train"] == 0.458  # median of 1/6 and 3/4


# -- against the installed TRL ----------------------------------------------------------------------
def test_trl_accepts_the_config_and_multiturn_note(tmp_path, tiny):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from arborl_bench.vs_trl_bench import multiturn_support

    args = GRPOConfig(**trl_args(Workload(), str(tmp_path)))
    assert args.bf16 is False and args.gradient_checkpointing is False and args.beta == 0.0
    ok, note = multiturn_support(tiny.tokenizer)
    assert not ok and "tool" in note  # SmolLM2's template: TRL's tools= refuses it


def test_timing_hooks_fit_installed_trl(tmp_path, tiny):
    """One TRL step on a tiny model with the bench's callback and method wrappers: the step is
    timed, generation is inside it, and TRL saw the tasks and prompt ids arborl would."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from arborl_bench.vs_trl_bench import instrument, trl_callback

    wl = Workload(steps=1, batch_tasks=2, group_size=2, max_tokens=3)
    calls = []
    timer = trl_callback(lambda k, rec: calls.append((k, rec)))
    args = {**trl_args(wl, str(tmp_path)), "gradient_accumulation_steps": 1}
    trainer = GRPOTrainer(model=tiny.model, reward_funcs=arith.trl_reward, args=GRPOConfig(**args),
                          train_dataset=Dataset.from_list(trl_dataset_rows(wl)), processing_class=tiny.tokenizer,
                          callbacks=[timer])
    prompt_ids, seen = {}, []
    instrument(trainer, timer, prompt_ids, seen)
    trainer.train()
    assert [k for k, _ in calls] == [0]
    rec = calls[0][1]
    assert 0 < rec["generate_only_s"] <= rec["generate_s"] < rec["step_s"] and rec["train_s"] > 0
    tasks = step_tasks(wl, 0)
    assert seen == [[t.task_id for t in tasks for _ in range(wl.group_size)]]
    renderer = ChatRenderer(tiny.tokenizer)
    for t in tasks:
        msgs = normalize_messages(task_messages(t, arith.SYSTEM_PROMPT))
        assert prompt_ids[t.task_id] == renderer.encode(renderer.render(msgs, None, add_generation_prompt=True))
    assert len(timer.logs) == 1 and math.isfinite(timer.logs[0]["loss"])


def test_missing_trl_says_how_to_install(monkeypatch):
    import io
    import sys

    from rich.console import Console

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl -> ImportError
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRL_EXPERIMENTAL_SILENCE"):
        monkeypatch.setenv(var, "1")
    buf = io.StringIO()
    out = get_benchmark("vs-trl")(quick=True, console=Console(file=buf, width=200))
    assert "pip install -e .[bench]" in buf.getvalue() and out["install"] == "pip install -e .[bench]"
    assert out["ratio_step"] is None and out["trl_step_s"] is None
