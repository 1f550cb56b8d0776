"""Scheduling on real built-in engines: the same policies and driver as the simulator, partial
rollout versions, KV migration by transfer, and the divided-rollout helpers."""

from __future__ import annotations

import pytest
import torch

from arborl.config import EngineConfig, load_config
from arborl.engine import LLMEngine
from arborl.models import tiny_llama
from arborl.scheduling.partial import continuation, mask_stale, merge, stale_token_mask
from arborl.scheduling.policies import Traced, replay
from arborl.scheduling.timeline import Timeline
from arborl.sim import build_policies, parse_variant, workload
from arborl.sim.engine_instance import EngineInstance, TokenStore, transfer_kv
from arborl.sim.instance import SimInstance
from arborl.sim.cost import CostModel
from arborl.sim.loop import RolloutDriver
from arborl.types import FinishReason, GenerateRequest, Sample, SamplingParams

VOCAB = 256
REAL = ["sim.prompts=3", "sim.group_size=3", "sim.instances=2", "sim.steps=2", "sim.prompt_tokens=12",
        "sim.length_median=14", "sim.sigma_prompt=0.8", "sim.sigma_member=0.3", "sim.max_tokens=60", "sim.min_tokens=2",
        "scheduling.chunk_tokens=8"]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and the machine is shared
    yield tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=3)
    torch.set_num_threads(threads)


def _engine(model, i=0, batch=4):
    return LLMEngine(model, EngineConfig(max_batch_size=batch, max_seq_len=160, engine_id=f"e{i}"), eos_token_ids=[VOCAB - 1], seed=i)


def _real_driver(model, variant, cfg, *, trace=True, timeline=None, instances=2):
    c, d = build_policies(cfg.scheduling, *parse_variant(variant), batch_size=cfg.sim.prompts, instances=instances)
    if trace:
        c, d = Traced(c), Traced(d)
    store = TokenStore(VOCAB)
    insts = []
    for i in range(instances):
        insts.append(EngineInstance(i, _engine(model, i), store, migration=cfg.scheduling.migration, peers=insts))
    drv = RolloutDriver(workload(cfg.sim), insts, c, d, steps=cfg.sim.steps, train_s=lambda n: 0.01,
                        partial_rollout=cfg.scheduling.partial_rollout, timeline=timeline)
    return drv, c, d, store


@pytest.mark.parametrize("variant", ["sync/seer", "async_ratio/pinned", "windowed_fifo/seer"])
def test_real_engines_and_simulator_make_the_same_decisions_on_the_same_events(model, variant):
    """The real-engine run's policy calls, replayed into policies built the way the simulator builds
    them, get the same answer at every call."""
    cfg = load_config(None, REAL)
    drv, c, d, store = _real_driver(model, variant, cfg)
    res = drv.run()
    assert res.figures["steps"] == 2
    # every planned token of every finished group was really generated, across chunks and instances
    w = workload(cfg.sim)
    finished = drv.finished_groups()
    assert len(finished) >= cfg.sim.prompts * cfg.sim.steps  # at least every trained group
    for gid, index in finished.items():
        for ep in w.group(index):
            assert len(store.ids[f"{gid}/m{ep.member}"]) == cfg.sim.prompt_tokens + ep.turns[0].tokens
    c2, d2 = build_policies(cfg.scheduling, *parse_variant(variant), batch_size=cfg.sim.prompts, instances=2)
    assert replay(c.calls, c2) > 10
    assert replay(d.calls, d2) > 10


def test_real_divided_rollout_migrates_and_transfers_kv(model):
    cfg = load_config(None, REAL + ["scheduling.migration=transfer", "sim.length_median=40"])
    tl = Timeline()
    drv, c, d, _ = _real_driver(model, "sync/seer", cfg, timeline=tl)
    drv.run()
    moved = [s for s in tl.spans]
    assert d.stats()["migrations"] > 0 and len(moved) > cfg.sim.prompts * cfg.sim.group_size
    assert sum(i.transfer_tokens for i in drv.instances) > 0


def test_kv_transfer_gives_the_same_tokens_as_recompute(model):
    ids = torch.randint(0, VOCAB - 1, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    src = _engine(model, 0)
    src.generate([GenerateRequest(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))])
    req = lambda: GenerateRequest(ids + [5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    ref = _engine(model, 1).generate([req()])[0]
    dst = _engine(model, 1)
    assert transfer_kv(src, dst, ids) == len(ids)
    got = dst.generate([req()])[0]
    assert got.cached_prompt_tokens == len(ids)  # the prefill of the context was skipped
    assert got.token_ids == ref.token_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-5)


def test_partial_rollout_tokens_carry_the_version_that_produced_them(model):
    """continue: a request in flight at a weight update keeps going, later tokens stamped v1;
    abort and resume: the continuation (prompt + tokens so far) runs under v1; merged, both read
    [0]*k + [1]*m; the stale-token mask drops exactly the v0 tokens when the gap is too large."""
    prompt = list(range(1, 9))
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    eng = _engine(model)
    seq = eng.add_request(GenerateRequest(prompt, params, request_id="a"))
    while len(seq.output) < 5:
        eng.step()
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    eng.update_weights(state, 1)
    (res,) = eng.run_until_done()
    k = res.versions.index(1)
    assert k >= 5 and res.versions == [0] * k + [1] * (12 - k)

    # abort-and-resume through the divided-rollout helpers, on two engines
    e0, e1 = _engine(model, 0), _engine(tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=3), 1)
    e1.update_weights(state, 1)
    pieces = []
    for eng_, n in ((e0, 4), (e1, None)):
        req = continuation(prompt, pieces, params, request_id=f"p{len(pieces)}", chunk_tokens=n or 0)
        pieces.append(eng_.generate([req])[0])
    assert continuation(prompt, pieces, params, request_id="done") is None
    merged = merge(prompt, pieces)
    assert merged.versions == [0] * 4 + [1] * 8 and len(merged.token_ids) == 12
    assert merged.finish_reason == FinishReason.LENGTH and merged.engine_id == "e0,e1"

    assert stale_token_mask(merged.versions, 2, 0) == [0] * 4 + [0] * 8
    assert stale_token_mask(merged.versions, 2, 1) == [0] * 4 + [1] * 8
    assert stale_token_mask(merged.versions, 2, None) == [1] * 12
    n = len(prompt)
    sample = Sample("e", "g", prompt + merged.token_ids, [0] * n + [1] * 12, [0.0] * (n + 12),
                    [-1] * n + merged.versions, [0] * (n + 12), [0.0] * (n + 12))
    masked, count = mask_stale(sample, 2, 1)
    assert count == 4 and masked.loss_mask == [0] * n + [0] * 4 + [1] * 8


def test_calibrated_simulator_predicts_the_real_engines_direction(model):
    """Same workload on real engines and on SimInstances with a cost model of the same engines: both see
    the same tokens, and the simulator predicts the real engines' ordering of two variants with a wide
    gap. One 16-member group per step on 4 engines of 4 slots: pinned runs it on one engine in 4 waves,
    Seer divides it over all four. The simulator (deterministic) predicts Seer more than 2x faster (~2.6x);
    the real engines must measure Seer faster too (~2.8x here: noise would have to slow one run by
    that much to flip it)."""
    cfg = load_config(None, REAL + ["sim.instances=4", "sim.prompts=1", "sim.group_size=16"])
    cost = CostModel(decode_base_s=0.002, decode_per_seq_s=2e-4, decode_per_ctx_token_s=0.0, prefill_base_s=0.001,
                     prefill_per_token_s=5e-5, kv_capacity_tokens=4 * 160, max_batch=4, weight_update_s=0.0)
    real, sim = {}, {}
    for variant in ("sync/pinned", "sync/seer"):
        drv, *_ = _real_driver(model, variant, cfg, trace=False, instances=4)
        real[variant] = drv.run().figures
        c, d = build_policies(cfg.scheduling, *parse_variant(variant), batch_size=cfg.sim.prompts, instances=4)
        sim[variant] = RolloutDriver(workload(cfg.sim), [SimInstance(i, cost) for i in range(4)], c, d,
                                     steps=cfg.sim.steps, train_s=lambda n: 0.01).run().figures
        assert sim[variant]["generated_tokens"] == real[variant]["generated_tokens"]
        assert sim[variant]["trained_tokens"] == real[variant]["trained_tokens"]
    time_s = lambda figs: {v: round(f["time_s"], 4) for v, f in figs.items()}
    assert 2 * sim["sync/seer"]["time_s"] < sim["sync/pinned"]["time_s"], (time_s(sim), time_s(real))  # the wide gap
    assert real["sync/seer"]["time_s"] < real["sync/pinned"]["time_s"], (time_s(sim), time_s(real))  # the same direction


def test_calibration_measures_the_engine_and_fits_it(model):
    """One decode point per (batch, context) with the batch's summed context, one prefill point per
    length, each a measured time; the fits are the simulator's own fits of those measurements, and their
    parameters, put into its ``CostModel``, give exactly the fits' predictions. How close a fit comes to
    the measurements depends on the machine's load (tests/test_sim.py checks the fitting on known costs);
    prefilling 512 tokens is measured slower than 16 (about 5x here)."""
    from arborl.sim.calibrate import calibrate
    from arborl.sim.cost import fit_decode, fit_prefill

    d, p = calibrate(model, VOCAB, batches=(1, 4), contexts=(16, 64), prefill_tokens=(16, 512), steps=3)
    grid = [(1, 16), (1, 64), (4, 16), (4, 64)]  # (batch, context per sequence), 3 decode steps each
    assert [b for b, *_ in d.points] == [b for b, _ in grid]
    assert all(b * ctx <= summed <= b * (ctx + 3) for (b, ctx), (_, summed, *_) in zip(grid, d.points))
    assert [n for n, *_ in p.points] == [16, 512]
    assert all(measured > 0 for *_, measured, _ in d.points + p.points)
    assert fit_decode([(b, c, m) for b, c, m, _ in d.points]) == d
    assert fit_prefill([(n, m) for n, m, _ in p.points]) == p
    cost = CostModel(**d.params, **p.params)
    for b, c, _, predicted in d.points:
        assert cost.step_s(b, c) == pytest.approx(predicted, rel=1e-9)
    for n, _, predicted in p.points:
        assert cost.prefill_s(n) == pytest.approx(predicted, rel=1e-9)
    assert p.points[1][1] > p.points[0][1]


def test_bench_migration_measurement_runs(model):
    from arborl_bench import scheduling_bench as sb

    rows = sb.measure_migration(tiny_llama(layers=2, hidden=64, vocab=sb.TINY["vocab"], heads=4, kv_heads=2), [32], reps=1)
    assert rows[0]["context"] == 32 and rows[0]["recompute_s"] > 0 and rows[0]["transfer_s"] > 0
