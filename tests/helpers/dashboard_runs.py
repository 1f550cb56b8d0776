"""Run directories for the dashboard tests: a real tiny training run (rollout through two engines under
the Seer dispatcher, in 4-token pieces, so its timeline has pieces and probes), a real tiny run with an SFT
warm start and held-out evaluations (before, after SFT, every step, after), and an agentic run
written through arborl's own writers (config, MetricsLog, Timeline, DataPool) with what a tiny random
model never produces: tool calls and results, a stitched second call, an aborted call, a call that
starts a new sample with a drift event, process rewards, sandbox output, hidden-test results,
trainer log-probs (of one call), metrics other helpers add (acceptance length, a custom column), and
held-out rows of two splits (eval, eval_perturbed) before, after SFT and after RL, as the job writes them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers.echo_env import echo_env
from helpers.tiny_run import tiny_cfg

from arborl.config import dump_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.models.loading import ensure_smollm2_dir
from arborl.report import MetricsLog
from arborl.scheduling.timeline import Timeline
from arborl.types import Call, Episode, EpisodeStatus


def trained_run(runs_dir: Path, name: str = "trained") -> Path:
    cfg = tiny_cfg(runs_dir, name, "rollout.steps=2", "scheduling.timeline=true", "scheduling.dispatch=seer",
                   "scheduling.chunk_tokens=4", "gateway.num_engines=2")
    train(cfg)
    return cfg.run_dir


def warm_run(runs_dir: Path, name: str = "warm") -> Path:
    """Two RL steps after an SFT warm start on a few transcripts; held-out evaluations before, after SFT, after
    step 1 (rollout.eval_every) and after; SFT's held-out NLL before and after it."""
    demos = runs_dir / f"{name}-demos.jsonl"  # a file, not a run directory: the dashboard passes it by
    demos.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w} {w}"}]}) + "\n"
        for w in ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano")))
    cfg = tiny_cfg(runs_dir, name, "rollout.steps=2", "rollout.eval_tasks=2", "rollout.eval_every=1",
                   f"train.sft.files=[{demos}]", "train.sft.batch_transcripts=4", "train.sft.heldout_fraction=0.25")
    train(cfg)
    return cfg.run_dir


def drifting_run(runs_dir: Path, name: str = "drifting") -> Path:
    """A real tiny run whose later calls drift (`arborl audit` finds them): three-turn episodes with
    stitching off, so each later call's prompt is the conversation rendered again as text, which a random
    model's replies do not re-tokenize to; every chat request recorded."""
    env = echo_env(runs_dir, f"{name}-echo.py")  # a file, not a run directory: the dashboard passes it by
    cfg = tiny_cfg(runs_dir, name, "rollout.task=gym", f"rollout.gym.env={env}", "rollout.max_turns=3",
                   "rollout.steps=1", "rollout.batch_tasks=2", "rollout.group_size=2", "rollout.max_tokens=6",
                   "gateway.stitching=false")
    train(cfg)
    return cfg.run_dir


def untokenized_run(runs_dir: Path, name: str = "untokenized") -> Path:
    """A run directory whose model has no tokenizer (token ids only) and an empty data pool."""
    cfg = tiny_cfg(runs_dir, name, "model.tiny_tokenizer=none")
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(dump_config(cfg))
    DataPool(cfg.run_dir / "datapool.sqlite").close()
    return cfg.run_dir


def smollm2_tokenizer():
    """SmolLM2's tokenizer (tokenizer.json, the tokenizers library) and its file."""
    from tokenizers import Tokenizer

    f = ensure_smollm2_dir(tiny_cfg(Path("."), "x").model.cache_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(f)), f


AGENTIC_STEPS = [
    {"kind": "step", "step": i + 1, "reward": r, "success": sc, "loss/total": loss,
     "spec/spec_mean_acceptance_length": acc, "zz_custom/metric": custom, "rollout_s": ro, "train_s": tr,
     "publish_s": pub, "step_s": ro + tr + pub + 0.25}
    for i, (r, sc, loss, acc, custom, ro, tr, pub) in enumerate([
        (0.25, 0.0, 0.5, 1.5, 7.0, 1.0, 0.5, 0.1), (0.5, 0.5, 0.25, 2.5, 8.0, 1.1, 0.4, 0.1),
        (0.75, 0.5, 0.125, 3.5, 9.0, 0.9, 0.5, 0.2)])
]
# held-out rows as run/job.py's _evaluate writes them on code_repair with eval_perturbed and an SFT warm start:
# (step, split, stage, eval_success)
AGENTIC_EVALS = [
    {"kind": "eval", "step": step, "split": split, "stage": stage, "eval_success": sc, "eval_reward": sc,
     "eval_tool_use": 1.0, "eval_s": 2.0}
    for step, split, stage, sc in [(0, "eval", "before", 0.25), (0, "eval_perturbed", "before", 0.125),
                                   (0, "eval", "after_sft", 0.5), (0, "eval_perturbed", "after_sft", 0.25),
                                   (3, "eval", "after", 0.75), (3, "eval_perturbed", "after", 0.375)]
]


def agentic_run(runs_dir: Path, name: str = "agentic") -> tuple[Path, dict]:
    """The run directory and what was written into it (episode id, calls, token ids, spans of step 1)."""
    cfg = tiny_cfg(runs_dir, name, "rollout.task=calculator", "rollout.steps=3", "train.lr=0.05",
                   "gateway.admin_key=sekrit-admin-key")
    run = cfg.run_dir
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    tok, tok_file = smollm2_tokenizer()
    (run / "checkpoint").mkdir()
    shutil.copy(tok_file, run / "checkpoint" / "tokenizer.json")
    log = MetricsLog(run / "metrics.jsonl")
    for row in AGENTIC_EVALS[:4] + AGENTIC_STEPS + AGENTIC_EVALS[4:]:
        log.write(row)

    # timeline of step 1 (index 0): request A in three pieces, the second on another engine (a migration),
    # request B a probe in one piece, request C cancelled
    tl = Timeline()
    for args in [(0.0, 0.5, "A", 0, 4, "chunk", False), (0.5, 1.0, "A", 1, 4, "chunk", False),
                 (1.0, 1.4, "A", 1, 2, "finish", False), (0.0, 0.7, "B", 0, 4, "finish", True),
                 (0.2, 0.3, "C", 1, 1, "cancel", False)]:
        start, end, rid, inst, tokens, ended, probe = args
        tl.start(start, f"req-{rid}0000000", "step0:t1", inst, probe=probe, step=0)
        tl.end(end, f"req-{rid}0000000", tokens, ended)
    tl.start(0.0, "req-D0000000", "step1:t1", 0, step=1)
    tl.end(1.0, "req-D0000000", 3, "finish")
    tl.mark(1.5, "publish", step=0)
    (run / "timeline").mkdir()
    tl.write_jsonl(run / "timeline" / "spans.jsonl")

    enc = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    ep = Episode("t1", "step0:t1", status=EpisodeStatus.FINISHED, episode_id="ep-agentic-1", reward=1.0,
                 reward_components={"outcome": 1.0, "used_tool": 1.0, "judge": 0.5},
                 interactions=[{"tool": "calculator", "arguments": {"expression": "12 * 7 + 5"}, "result": "89"}],
                 meta={"rewards": [{"value": 0.5, "after_call": "call-agentic-1"}],
                       "sandbox": {"stdout": "3 passed, 1 failed", "exit_code": 1},
                       "hidden_tests": {"passed": 3, "failed": 1}})
    p1 = enc("<|im_start|>user\nWhat is 12 * 7 + 5?<|im_end|>\n<|im_start|>assistant\n")
    c1_out = enc('<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7 + 5"}}</tool_call>')
    suffix = enc("<|im_end|>\n<|im_start|>tool\n89<|im_end|>\n<|im_start|>assistant\n")
    c2_out = enc("Answer: 89")
    n1, n2 = len(c1_out), len(c2_out)
    c1 = Call("ep-agentic-1", p1, c1_out, [-0.1 * (i + 1) for i in range(n1)], [-0.1 * (i + 1) for i in range(n1)],
              [0] * n1, "stop", call_id="call-agentic-1", engine_id="engine-0",
              meta={"tool_calls": 1})
    c1_trainer = [-0.1 * (i + 1) - 0.05 for i in range(n1)]
    c2 = Call("ep-agentic-1", p1 + c1_out + suffix, c2_out, [-2.0] * n2, [-2.0] * n2, [1] * n2, "stop",
              call_id="call-agentic-2", engine_id="engine-1", meta={"tool_calls": 0})
    aborted_out = enc(" partial")
    c3 = Call("ep-agentic-1", p1 + c1_out + suffix + c2_out, aborted_out, [-1.0] * len(aborted_out),
              [-1.0] * len(aborted_out), [1] * len(aborted_out), "abort", call_id="call-agentic-3")
    p4 = enc("<|im_start|>user\nAgain: 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    c4_out = enc("4")
    c4 = Call("ep-agentic-1", p4, c4_out, [-0.5] * len(c4_out), [-0.5] * len(c4_out), [1] * len(c4_out), "stop",
              call_id="call-agentic-4", meta={"drift": {"position": 3, "reason": "history edited by the agent"}})
    ep.calls = [c1, c2, c3, c4]
    other = Episode("t1", "step0:t1", status=EpisodeStatus.FINISHED, episode_id="ep-agentic-2", reward=0.0,
                    reward_components={"outcome": 0.0})
    other.calls = [Call("ep-agentic-2", p1, c2_out, [-1.0] * n2, [-1.0] * n2, [0] * n2, "stop",
                        call_id="call-agentic-5")]
    with DataPool(run / "datapool.sqlite") as pool:
        pool.put_episode(ep)
        pool.put_episode(other)
        pool.record_trainer_logprobs(1, {"call-agentic-1": c1_trainer})
    # what the trainer sees, built by hand from the calls (not by train/samples.py): sample 1 is call 1's
    # prompt + completion, call 2's new prompt tokens + completion; call 3 is aborted; sample 2 is call 4
    sample1 = ([(t, 0) for t in p1] + [(t, 1) for t in c1_out] + [(t, 0) for t in suffix] + [(t, 1) for t in c2_out])
    sample2 = [(t, 0) for t in p4] + [(t, 1) for t in c4_out]
    return run, {"episode_id": "ep-agentic-1", "samples": [sample1, sample2], "tokenizer": tok,
                 "trainer_logprobs": c1_trainer, "c1_logprobs": c1.logprobs}
