"""``arborl bench progress``: its configurations are valid configs of the job that turn their lever on, its time
split sums to the steps' wall time, time to target reads the first evaluation at or above it, the mismatch,
packing and staleness figures are the steps' metrics (None where a run did not log them). (The bench itself runs the real
job for tens of minutes: `arborl bench progress --quick`, not here.)"""

from __future__ import annotations

import pytest
import yaml

from arborl.config import load_config
from arborl_bench import BENCHMARKS
from arborl_bench.progress_bench import ASYNC as ASYNC_SETS
from arborl_bench.progress_bench import JOB, LEVERS, PARTIAL, STACK, configurations, mean_se, summarise, time_to


def test_every_configuration_is_a_valid_config_of_the_job_and_turns_its_lever_on():
    assert "progress" in BENCHMARKS
    base = load_config(JOB, [])
    quick = configurations(quick=True)
    assert [(n, s) for n, _, s in quick] == [("baseline", 0), ("stack", 0)]
    full = configurations(quick=False)
    assert sum(n == "baseline" for n, _, _ in full) == 3 and sum(n == "stack" for n, _, _ in full) == 3
    assert {n for n, _, _ in full} == {"baseline", "stack", *LEVERS}
    for name, over, _ in full:
        cfg = load_config(JOB, over)
        assert (cfg.model_dump() == base.model_dump()) == (not over), name
    for name, over in LEVERS.items():  # every setting of a lever lands in the config, and one at least is new
        cfg = load_config(JOB, over)
        pairs = [o.split("=", 1) for o in over]
        assert all(setting(cfg, k) == yaml.safe_load(v) for k, v in pairs), name
        assert any(setting(base, k) != yaml.safe_load(v) for k, v in pairs), name
    assert (base.engine.weights_dtype, base.train.correction.mode) == ("float32", "none")
    for name, dtype in (("bf16_rollout_tis", "bfloat16"), ("int8_rollout", "int8")):
        cfg = load_config(JOB, LEVERS[name])  # int8 is the CPU's (the job's model.device)
        assert (cfg.engine.weights_dtype, cfg.train.correction.mode, cfg.model.device) == (dtype, "tis", "cpu"), name
    stack = load_config(JOB, STACK)
    assert stack.engine.spec.enabled and stack.engine.spec.prompt_lookup
    assert stack.scheduling.consume == "async_ratio"
    assert stack.train.advantage.shaping.component_weights == {"tests_passed_frac": 0.5}


def setting(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def rows() -> list[dict]:
    steps = [{"kind": "step", "step": i, "step_s": 10.0 + i, "rollout_s": 6.0, "train_s": 3.0, "publish_s": 0.5,
              "generated_tokens": 100 * i, "rollout_tokens_per_s": 50.0, "spec/spec_mean_acceptance_length": 2.0 + i}
             for i in (1, 2, 3, 4)]
    evals = [{"kind": "eval", "step": s, "split": split, "eval_success": v}
             for s, v in ((0, 0.4), (2, 0.5), (4, 0.6)) for split in ("eval", "eval_perturbed")]
    return [evals[0], evals[1], *steps[:2], evals[2], evals[3], *steps[2:], evals[4], evals[5]]


def test_the_time_split_sums_to_the_steps_wall_time_and_the_curve_is_on_training_time():
    r = summarise("baseline", 0, rows(), peak=3_000_000_000, wall=99.0)
    split = r["time_split_s"]
    assert split["rollout_s"] + split["train_s"] + split["publish_s"] + split["other_s"] == pytest.approx(split["step_s"])
    assert split["step_s"] == pytest.approx(11 + 12 + 13 + 14) and split["other_s"] == pytest.approx(50 - 4 * 9.5)
    assert r["curve"]["eval"] == [(0, 0.0, 0, 0.4), (2, 23.0, 300, 0.5), (4, 50.0, 1000, 0.6)]
    assert r["success_before"] == {"eval": 0.4, "eval_perturbed": 0.4}
    assert r["success_final"] == {"eval": 0.6, "eval_perturbed": 0.6}
    assert r["rollout_tokens_per_s"] == 50.0 and r["spec_acceptance_length"] == pytest.approx(4.5)
    assert r["peak_rss_gb"] == 3.0
    assert time_to(r, 0.5) == 23.0 and time_to(r, 0.6) == 50.0 and time_to(r, 0.61) is None
    assert time_to(r, 0.3) == 23.0  # the evaluation before RL never counts as reaching it


def test_mismatch_packing_and_staleness_are_the_steps_metrics_and_none_where_not_logged():
    logged = rows()
    steps = [r for r in logged if r["kind"] == "step"]
    figures = [(0.25, 300.0, 400.0, 0), None, (0.5, 100.0, 400.0, 2), (0.0, 200.0, 200.0, 1)]
    for r, f in zip(steps, figures):
        if f is None:  # a step with no loss tokens: the trainer skips it, no mismatch or packing metrics
            r.update({"train/skipped": 1.0, "sched/max_version_gap": 1})
        else:
            r.update({"mismatch/k3_kl": f[0], "train/packed_tokens": f[1], "train/flat_tokens": f[2],
                      "sched/max_version_gap": f[3]})
    r = summarise("int8_rollout", 0, logged, peak=0, wall=1.0)
    assert r["mismatch_k3_kl"] == 0.25  # (0.25 + 0.5 + 0) / 3: the skipped step has none, a step's 0 counts
    assert r["packed_over_flat"] == 0.6  # 600 / 1000 over the steps, not the mean of the steps' ratios
    assert (r["version_gap_mean"], r["version_gap_max"]) == (1.0, 2)
    old = summarise("baseline", 0, rows(), peak=0, wall=1.0)  # a run from before these metrics
    assert [old[k] for k in ("mismatch_k3_kl", "packed_over_flat", "version_gap_mean", "version_gap_max")] == [None] * 4


def test_mean_and_standard_error():
    assert mean_se([1.0]) == (1.0, 0.0)
    m, se = mean_se([1.0, 2.0, 3.0])
    assert m == 2.0 and se == pytest.approx((1.0 / 3) ** 0.5)


def test_only_picks_levers_beside_the_baseline_and_refuses_unknown_names():
    assert [n for n, _, _ in configurations(quick=True, only="spec, async")] == ["baseline", "spec", "async"]
    assert [(n, s) for n, _, s in configurations(quick=True, only="bf16_rollout", seeds="1,2")] == [
        ("baseline", 1), ("bf16_rollout", 1), ("baseline", 2), ("bf16_rollout", 2)]
    with pytest.raises(ValueError, match="unknown configuration"):
        configurations(quick=True, only="warp")


def test_a_run_with_the_stack_on_trains_and_records_every_episode(tmp_path):
    """The stack's knobs (speculative decoding with prompt lookup, asynchronous consumption, partial credit
    weights) on a real tiny run: every step trains, every episode ends in the data pool with a final status and
    a reward, none left running, no infrastructure failure."""
    import json

    from arborl.datapool import DataPool
    from arborl.run.job import train
    from helpers.tiny_run import tiny_cfg

    stack = [x for x in STACK if not x.startswith("train.advantage")] + [
        "train.advantage.shaping.component_weights={outcome: 0.5}"]  # even_tokens reports its outcome only
    cfg = tiny_cfg(tmp_path, "stack", "rollout.steps=3", "engine.spec.min_match=1", "engine.spec.adaptive=false", *stack)
    train(cfg)
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["samples"] > 0 for r in steps)
    assert all(r["rollout/infra_failures"] == 0 for r in steps)
    # speculation ran: the speculative decoder took the decode steps (whether a random tiny model's tokens
    # repeat enough to draft from depends on which policy version generated them, i.e. on timing; drafting
    # itself is tested in test_specdec_*)
    assert sum(r.get("spec/spec_verify_steps", 0) + r.get("spec/spec_plain_steps", 0) for r in steps) > 0
    assert max(r["sched/max_version_gap"] for r in steps) >= 1  # asynchronous: a batch from an older policy
    seen = summarise("stack", 0, rows, peak=0, wall=1.0)  # the bench's figures read the keys the run logs
    assert seen["mismatch_k3_kl"] >= 0 and 0 < seen["packed_over_flat"] <= 1 and seen["version_gap_max"] >= 1
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        eps = pool.episodes(with_calls=False)
    assert eps and not [e for e in eps if e.status == "running"]
    trained = sum(r["episodes"] for r in steps)
    finished = [e for e in eps if e.status == "finished"]
    assert len(finished) >= trained and all(e.reward == pytest.approx(1.5 * e.reward_components["outcome"])
                                            for e in finished)


def test_the_simulator_calibrated_on_a_runs_trace_predicts_its_step_time(tmp_path):
    """progress_sim: the workload and trainer read from a real (tiny) run's data pool and metrics, the engine's
    costs given; the simulated sync step is a positive time of the run's order, and the bench's
    configurations map to the simulator's variants."""
    import json

    from arborl.run.job import train
    from arborl_bench.progress_sim import predict, sim_knobs, variant_of
    from helpers.tiny_run import tiny_cfg

    cfg = tiny_cfg(tmp_path, "trace", "rollout.steps=2")
    train(cfg)
    engine = {"decode_base_s": 0.002, "decode_per_seq_s": 1e-4, "decode_per_ctx_token_s": 1e-7,
              "prefill_base_s": 0.001, "prefill_per_token_s": 1e-5, "prefill_per_token2_s": 0.0}
    knobs = sim_knobs(cfg.run_dir, engine, max_batch=16)
    assert knobs["prompts"] == 4 and knobs["group_size"] == 4 and knobs["steps"] == 2
    assert knobs["turns"] == 1 and knobs["max_tokens"] <= 8 and knobs["train_per_ktoken_s"] > 0
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_s = sum(r["train_s"] for r in rows if r.get("kind") == "step") / 2
    step = predict(knobs, "sync/pinned")
    assert step >= train_s * 0.5 > 0  # the trainer's share alone is about half of it or more
    assert variant_of("baseline", [], None) == ("sync/pinned", {}, {})
    assert variant_of("async", ASYNC_SETS, None) == ("async_ratio/pinned", {"async_ratio": "1"}, {})
    assert variant_of("spec", ["engine.spec.enabled=true"], 0.5)[2] == {"spec_acceptance": 0.5}


def test_the_simulator_learns_which_groups_train_from_the_trace_and_partial_credit_adds_to_them(tmp_path):
    """progress_sim: the share of groups with a learning signal comes from the trace's rewards, and a
    configuration's reward components (partial credit) are added to each episode's recorded ones before it
    is counted; the trainer's time is per generated token of the groups that trained. A hand-made trace of
    known numbers; the prediction with partial credit trains more groups, so its step is longer."""
    import json

    from arborl.datapool import DataPool
    from arborl.types import Call, Episode, EpisodeStatus
    from arborl_bench.progress_sim import component_weights_of, predict, sim_knobs

    groups = {"g0": ([1.0, 0.0], [1.0, 0.5]), "g1": ([0.0, 0.0], [0.5, 0.0]),  # mixed; mixed with partial credit
              "g2": ([0.0, 0.0], [0.25, 0.25]), "g3": ([1.0, 1.0], [1.0, 1.0])}  # equal either way
    with DataPool(tmp_path / "datapool.sqlite") as pool:
        for gid, (rewards, passed) in groups.items():
            for m, (r, p) in enumerate(zip(rewards, passed)):
                ep = Episode(task_id=gid, group_id=gid, status=EpisodeStatus.FINISHED, reward=r,
                             reward_components={"outcome": r, "tests_passed_frac": p}, finished_at=1.0)
                n = 10 + m  # g0 trains 10 + 11 tokens
                ep.calls = [Call(ep.episode_id, [1] * 20, [2] * n, [0.0] * n, [0.0] * n, [0] * n, "stop")]
                pool.put_episode(ep)
    step = {"kind": "step", "train_s": 1.05, "generated_tokens": 42, "publish_s": 0.1}
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({**step, "step": s}) for s in (1, 2)) + "\n")
    engine = {"decode_base_s": 0.002, "decode_per_seq_s": 1e-4, "decode_per_ctx_token_s": 1e-7,
              "prefill_base_s": 0.001, "prefill_per_token_s": 1e-5, "prefill_per_token2_s": 0.0}

    partial = component_weights_of(["engine.spec.enabled=true", PARTIAL[0]])
    assert partial == {"tests_passed_frac": 0.5} and component_weights_of(["engine.spec.enabled=true"]) == {}
    base = sim_knobs(tmp_path, engine, max_batch=16)
    credit = sim_knobs(tmp_path, engine, max_batch=16, component_weights=partial)
    assert base["mixed_fraction"] == 0.25 and credit["mixed_fraction"] == 0.5
    assert base["train_per_ktoken_s"] == pytest.approx(2.1 / 0.021)  # 2 steps' train_s over g0's 21 tokens
    assert credit["train_per_ktoken_s"] == base["train_per_ktoken_s"]  # the trainer's speed is the trace's
    knobs = {"steps": 8}
    assert predict({**credit, **knobs}, "sync/pinned") > predict({**base, **knobs}, "sync/pinned")
