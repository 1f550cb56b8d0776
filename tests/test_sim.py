"""The simulator: cost model, simulated instances, the driver with every policy, record / replay."""

from __future__ import annotations

import json
import math
import random

import pytest
from typer.testing import CliRunner

from arborl.cli import app
from arborl.config import load_config
from arborl.scheduling.policies import ReplayMismatch, replay, window_items
from arborl.scheduling.dispatch import make_dispatch
from arborl.sim import build_policies, parse_variant, run_variant, simulate, workload
from arborl.sim.cost import CostModel, fit_decode, fit_prefill
from arborl.sim.instance import Admit, SimInstance

SMALL = ["sim.prompts=6", "sim.group_size=4", "sim.instances=3", "sim.steps=3", "sim.length_median=300",
         "sim.max_tokens=2000", "sim.prompt_tokens=64", "sim.kv_capacity_tokens=6000", "sim.max_batch=16",
         "sim.train_base_s=2", "sim.weight_update_s=1", "scheduling.chunk_tokens=128", "scheduling.starvation_s=30"]
AGENTIC = SMALL + ["sim.turns=3", "sim.obs_tokens=32", "sim.env_median_s=2", "sim.length_median=80"]
VARIANTS = ["sync/pinned", "sync/seer", "async_ratio/pinned", "async_ratio/seer", "windowed_fifo/pinned",
            "windowed_fifo/seer"]


def test_cost_model_segments_are_exact():
    c = CostModel(decode_base_s=0.01, decode_per_seq_s=0.001, decode_per_ctx_token_s=1e-6)
    for B, C, s in [(1, 10, 1), (4, 1000, 17), (32, 50_000, 300)]:
        loop = sum(c.step_s(B, C + B * i) for i in range(s))
        assert c.steps_s(B, C, s) == pytest.approx(loop)
        for frac in (0.01, 0.5, 0.999, 1.0):
            n = c.steps_within(B, C, frac * loop)
            assert c.steps_s(B, C, n) >= frac * loop - 1e-12 and (n == 1 or c.steps_s(B, C, n - 1) < frac * loop)


def test_fit_recovers_known_lines():
    rng = random.Random(0)
    pts = [(b, ctx, 0.004 + 0.0005 * b + 3e-7 * ctx) for b in (1, 2, 8, 16) for ctx in (100, 5000, 20000)]
    f = fit_decode([(b, c, y * (1 + 0.01 * rng.uniform(-1, 1))) for b, c, y in pts])
    assert f.params["decode_base_s"] == pytest.approx(0.004, rel=0.1)
    assert f.params["decode_per_seq_s"] == pytest.approx(0.0005, rel=0.1)
    assert f.params["decode_per_ctx_token_s"] == pytest.approx(3e-7, rel=0.1)
    assert f.r2 > 0.98 and f.max_rel_err < 0.05
    p = fit_prefill([(n, 0.002 + 1e-4 * n) for n in (16, 64, 256)])
    assert p.params["prefill_per_token_s"] == pytest.approx(1e-4, rel=1e-6)
    assert p.params["prefill_per_token2_s"] == pytest.approx(0.0, abs=1e-12)  # a line has no quadratic part
    q = fit_prefill([(n, 1e-3 + 2e-5 * n + 1e-7 * n * n) for n in (16, 128, 512, 1024)])
    assert q.params["prefill_per_token2_s"] == pytest.approx(1e-7, rel=1e-4) and q.max_rel_err < 1e-6
    # superlinear timings that a line could only fit with a negative base: the base is dropped, not clamped
    r = fit_prefill([(16, 0.00077), (512, 0.0685)])
    assert min(r.params.values()) >= 0 and r.max_rel_err < 1e-6


def test_the_prefill_quadratic_knob_reaches_the_simulators_cost():
    from arborl.config import load_config
    from arborl.sim import cost_model

    plain = cost_model(load_config(None, []).sim)
    quad = cost_model(load_config(None, ["sim.prefill_per_token2_s=1e-7"]).sim)
    assert quad.prefill_s(1000) == pytest.approx(plain.prefill_s(1000) + 0.1) and plain.prefill_per_token2_s == 0


def _drain(inst: SimInstance):
    ends = []
    while inst.next_event_time() < math.inf:
        ends += inst.run_next()
    return ends


def test_sim_instance_conserves_tokens_and_preempts_when_memory_runs_out():
    c = CostModel(kv_capacity_tokens=700, max_batch=8, prefill_per_token_s=1e-4)
    inst = SimInstance(0, c)
    for i in range(6):
        inst.admit(Admit(f"r{i}", f"l{i}", context=50, stop_after=100 + 20 * i), 0.0)
    ends = _drain(inst)
    assert sorted(e.request_id for e in ends) == [f"r{i}" for i in range(6)]
    assert {e.request_id: e.tokens for e in ends} == {f"r{i}": 100 + 20 * i for i in range(6)}
    assert inst.stats()["preemptions"] > 0  # 6 x (50 + 100 + ...) > 700
    assert inst.kv_used == 0 and inst.stats()["tokens"] == sum(100 + 20 * i for i in range(6))


def test_sim_instance_sync_to_never_skips_an_event_and_prefix_cache_hits():
    c = CostModel(kv_capacity_tokens=10_000)
    a, b = SimInstance(0, c), SimInstance(0, c)
    for inst in (a, b):
        inst.admit(Admit("x", "lx", 100, 50), 0.0)
        inst.admit(Admit("y", "ly", 100, 80), 0.0)
    ends_a = _drain(a)
    ends_b = []
    t = 0.0
    while b.next_event_time() < math.inf:  # the same run, interrupted at many points
        t += 0.013
        ends_b += b.sync_to(min(t, b.next_event_time()))
    assert [(e.request_id, e.tokens) for e in ends_a] == [(e.request_id, e.tokens) for e in ends_b]
    # a continuation on the same instance finds its KV in the prefix cache: no prefill
    before = a.stats()["prefill_tokens"]
    a.admit(Admit("x2", "lx", 150, 10), a.clock)
    assert a.stats()["prefill_tokens"] == before and a.stats()["cached_tokens"] >= 150


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("work", ["single", "agentic"])
def test_driver_runs_every_policy_and_keeps_its_invariants(variant, work):
    cfg = load_config(None, SMALL if work == "single" else AGENTIC)
    res, _ = run_variant(cfg, variant, timeline=True)
    f = res.figures
    consume = variant.split("/")[0]
    assert f["steps"] == 3 and len(res.batches) == 3
    assert all(b["items"] == 6 for b in res.batches)
    gap = {"sync": 0, "async_ratio": 1}.get(consume)
    if gap is not None:
        assert f["consume_max_version_gap"] <= gap
    if consume == "windowed_fifo":
        assert f["consume_max_out_of_order"] <= window_items(0.3, 6) - 1
    # every token is accounted for: trained, wasted, or still in flight when the run stopped
    assert f["trained_tokens"] + f["wasted_tokens"] <= f["generated_tokens"] + 1e-6
    if consume == "sync":
        assert f["wasted_tokens"] == 0 and f["trained_tokens"] == f["generated_tokens"]
    spans = res.timeline.spans
    assert spans and all(s.end >= s.start for s in spans)
    if variant.endswith("/pinned"):  # a request never leaves its group's instance
        inst_of = {}
        for s in spans:
            assert inst_of.setdefault(s.group_id, s.instance) == s.instance
        assert f["dispatch_migrations"] == 0


def test_seer_beats_pinned_on_a_long_tailed_workload():
    """Work-bound (not bound by the single longest request): the memory-starved pinned instances stall."""
    cfg = load_config(None, ["sim.prompts=64", "sim.group_size=8", "sim.instances=8", "sim.steps=1",
                             "sim.length_median=1500", "sim.max_tokens=8000", "sim.kv_capacity_tokens=25000",
                             "scheduling.chunk_tokens=512"])
    pinned, _ = run_variant(cfg, "sync/pinned")
    seer, _ = run_variant(cfg, "sync/seer")
    assert seer.figures["rollout_tokens_per_s"] > 1.2 * pinned.figures["rollout_tokens_per_s"]
    assert seer.figures["tail_s"] < 0.5 * pinned.figures["tail_s"]
    assert seer.figures["generated_tokens"] == pinned.figures["generated_tokens"]  # the same workload


def test_async_beats_sync_when_training_and_env_latency_dominate():
    cfg = load_config(None, AGENTIC + ["sim.train_base_s=20", "sim.env_sigma=1.5", "sim.steps=5"])
    s, _ = run_variant(cfg, "sync/pinned")
    a, _ = run_variant(cfg, "async_ratio/pinned")
    assert a.figures["train_tokens_per_s"] > 1.3 * s.figures["train_tokens_per_s"]


@pytest.mark.parametrize("variant", ["sync/seer", "async_ratio/pinned", "windowed_fifo/seer"])
def test_recorded_decisions_replay_identically_into_fresh_policies(variant):
    cfg = load_config(None, AGENTIC)
    res, calls = run_variant(cfg, variant, trace=True)
    assert len(calls["consume"]) > 20 and len(calls["dispatch"]) > 50
    c, d = build_policies(cfg.scheduling, *parse_variant(variant), batch_size=cfg.sim.prompts,
                          instances=cfg.sim.instances)
    assert replay(calls["consume"], c) == len(calls["consume"])
    assert replay(calls["dispatch"], d) == len(calls["dispatch"])
    # and a policy that decides differently is caught
    other = make_dispatch(cfg.scheduling.model_copy(update={"chunk_tokens": 7}), cfg.sim.instances,
                          name="pinned" if variant.endswith("seer") else "seer")
    with pytest.raises(ReplayMismatch):
        replay(calls["dispatch"], other)


def test_partial_rollout_abort_resume_never_spans_a_weight_update():
    base = AGENTIC + ["sim.train_base_s=1", "sim.steps=4", "scheduling.chunk_tokens=0", "sim.env_median_s=0.5"]
    for mode in ("continue", "abort_resume"):
        cfg = load_config(None, base + [f"scheduling.partial_rollout={mode}"])
        res, _ = run_variant(cfg, "async_ratio/pinned", timeline=True)
        publishes = [e["t"] for e in res.timeline.events if e["kind"] == "publish"]
        crossing = [s for s in res.timeline.spans if any(s.start < t < s.end for t in publishes)]
        if mode == "abort_resume":
            assert not crossing  # every request in flight was cut at the update and resumed
        else:
            assert crossing  # requests run through the update; their later tokens carry the new version


def test_simulate_reports_every_policy_and_ratios():
    cfg = load_config(None, SMALL + ["sim.policies=[sync/pinned,sync/seer,async_ratio/pinned]"])
    out = simulate(cfg)
    assert set(out["policies"]) == {"sync/pinned", "sync/seer", "async_ratio/pinned"}
    r = out["ratios_vs_sync_pinned"]
    assert set(r) == {"sync/seer", "async_ratio/pinned"} and r["sync/seer"]["rollout_throughput"] > 0
    json.dumps(out)


def test_cli_simulate_prints_one_json_object(tmp_path):
    runner = CliRunner()
    args = ["simulate"] + [x for kv in SMALL for x in ("--set", kv)] + ["--set", f"sim.gantt_dir={tmp_path}"]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    data = json.loads(line)
    assert "sync/seer" in data["policies"] and data["policies"]["sync/seer"]["gantt"].endswith(".png")
    assert (tmp_path / "sync_seer.png").stat().st_size > 1000
    bad = runner.invoke(app, ["simulate", "--set", "sim.policies=[sync/nope]"])
    assert bad.exit_code == 2 and "unknown dispatch policy" in bad.output


def test_oversampling_cancels_the_surplus_once_the_batch_is_full():
    cfg = load_config(None, SMALL + ["scheduling.oversample=0.5"])
    res, _ = run_variant(cfg, "sync/seer", timeline=True)
    f = res.figures
    assert all(b["items"] == 6 for b in res.batches)
    assert f["groups_started"] == 3 * 9  # ceil(1.5 * 6) per step
    assert f["consume_cancelled"] + f.get("consume_dropped_surplus", 0) == 3 * 3
    assert f["consume_cancelled"] > 0 and f["wasted_tokens"] > 0
    assert any(s.ended == "cancel" for s in res.timeline.spans)
    # the surplus are the slowest groups: over-sampled steps are shorter
    plain, _ = run_variant(load_config(None, SMALL), "sync/seer")
    assert f["batch_makespan_s"] < plain.figures["batch_makespan_s"]


def test_oracle_reference_runs_longest_true_length_first():
    """The bench's oracle reference (true lengths known in advance) dispatches, among the first
    assignments, requests in non-increasing true length; it is a drop-in dispatch policy."""
    from arborl_bench.scheduling_bench import OracleLongestFirst
    from arborl.scheduling.policies import Traced
    from arborl.sim import workload

    cfg = load_config(None, SMALL + ["sim.steps=1"])
    wl = workload(cfg.sim)
    oracle = Traced(OracleLongestFirst(wl, chunk_tokens=0))
    res, _ = run_variant(cfg, "sync/seer", dispatch_policy=oracle)
    assert res.figures["steps"] == 1
    first = [a.request_id for name, _, a in oracle.calls if name == "next_for" and a is not None][:cfg.sim.instances]
    def true_length(rid: str) -> int:  # request ids are g<group>/m<member>/t<turn> (sim.loop)
        g, m, t = rid.split("/")
        (plan,) = [p for p in wl.group(int(g[1:])) if p.member == int(m[1:])]
        return plan.turns[int(t[1:])].tokens

    lengths = [true_length(rid) for rid in first]
    assert lengths == sorted(lengths, reverse=True)
    every = sorted((p.turns[0].tokens for g in range(cfg.sim.prompts) for p in wl.group(g)), reverse=True)
    assert lengths == every[: len(lengths)]


def test_groups_without_a_learning_signal_train_nothing_and_dynamic_sampling_draws_again():
    """``sim.mixed_fraction``: a group's rewards differ with that probability, on a stream of its own (the
    lengths stay); the trainer skips all-equal groups (train.advantage.drop_zero_variance), and dynamic consumption
    drops them and draws more groups, so its steps take longer and train only mixed groups."""
    half = SMALL + ["sim.mixed_fraction=0.5", "sim.train_base_s=0", "sim.steps=6"]
    cfg = load_config(None, half)
    work = workload(cfg.sim)
    mixed = [work.mixed(i) for i in range(400)]
    assert 0.4 < sum(mixed) / 400 < 0.6
    assert [work.rewards(i) for i in range(3)] == [[1.0 if m == 0 and mixed[i] else 0.0 for m in range(4)]
                                                   for i in range(3)]
    everyone = workload(load_config(None, SMALL).sim)
    assert all(everyone.mixed(i) for i in range(400))
    assert [work.group(i) for i in range(20)] == [everyone.group(i) for i in range(20)]

    sync, _ = run_variant(cfg, "sync/pinned")
    f = sync.figures
    assert f["groups_started"] == 36 and f["generated_tokens"] > f["trained_tokens"] > 0
    trained = sum(b["trained_items"] for b in sync.batches)
    assert trained == sum(mixed[:36]) and all(b["items"] == 6 for b in sync.batches)
    kept, _ = run_variant(load_config(None, half + ["train.advantage.drop_zero_variance=false"]), "sync/pinned")
    assert kept.figures["trained_tokens"] == f["generated_tokens"]  # the same groups, all trained
    assert kept.figures["step_s"] > f["step_s"]  # training every group takes longer

    dyn, _ = run_variant(cfg, "dynamic/pinned")
    d = dyn.figures
    assert d["groups_started"] > f["groups_started"] and d["consume_dropped"] > 0
    assert all(b["trained_items"] == b["items"] for b in dyn.batches)  # every kept group has a signal
    assert d["trained_tokens"] > f["trained_tokens"]
    full, _ = run_variant(load_config(None, SMALL + ["sim.train_base_s=0", "sim.steps=6"]), "dynamic/pinned")
    assert full.figures["groups_started"] == 36 and full.figures["consume_dropped"] == 0
