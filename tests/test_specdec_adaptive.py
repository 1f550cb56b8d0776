"""Adaptive draft length (Seer's marginal-benefit rule), the knobs of ``engine.spec``, and the metrics
in engine stats, the engine pool's rows (GET /health) and step metrics. ~3 s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from arborl.config import EngineConfig, SpecConfig
from arborl.engine import AsyncEngine, LLMEngine
from arborl.engine.pool import EnginePool
from arborl.engine.specdec.adaptive import AdaptiveLength, VerifyProfile
from arborl.models import tiny_llama
from arborl.types import GenerateRequest, SamplingParams

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is faster


def profile(fn, batches=(1, 2, 4, 8, 16, 32), positions=(0, 1, 2, 4)) -> VerifyProfile:
    return VerifyProfile(list(batches), list(positions), [[fn(b, n) for n in positions] for b in batches])


def test_off_where_verify_cost_exceeds_the_gain():
    # memory-bound at small batch (cost ~ flat in tokens), compute-bound at large batch (~ tokens)
    roofline = profile(lambda b, n: max(1.0, b * (n + 1) / 8))
    length = AdaptiveLength(max_k=4, prior=0.6, profile=roofline)
    assert length.choose(1) == 4 and length.choose(2) >= 2
    assert length.choose(32) == 0  # speculation off: 1 + 0.6 tokens would cost 2x the time
    # verify cost above the gain at every batch: off everywhere
    pricey = AdaptiveLength(max_k=4, prior=0.6, profile=profile(lambda b, n: 1.0 + n))
    assert all(pricey.choose(b) == 0 for b in (1, 4, 32))
    # live acceptance: drafts that keep being rejected turn it off even where verifying is cheap
    cheapish = AdaptiveLength(max_k=4, prior=0.6, profile=profile(lambda b, n: 1.0 + 0.2 * n))
    assert cheapish.choose(1) > 0
    for _ in range(200):
        cheapish.record(0)
    assert cheapish.choose(1) == 0
    for _ in range(400):
        cheapish.record(4)
    assert cheapish.choose(1) == 4
    # drafting time counts too
    slow_drafter = AdaptiveLength(max_k=4, prior=0.6, profile=profile(lambda b, n: 1.0))
    slow_drafter.record_draft_time(5.0, 1)
    assert slow_drafter.choose(1) == 0
    # a lower prior acceptance shortens k before anything is measured
    assert AdaptiveLength(max_k=4, prior=0.3, profile=profile(lambda b, n: 1.0 + 0.3 * n)).choose(1) < \
        AdaptiveLength(max_k=4, prior=0.9, profile=profile(lambda b, n: 1.0 + 0.3 * n)).choose(1)


def make_engine(**spec) -> LLMEngine:
    model = tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    cfg = EngineConfig(max_seq_len=256, max_batch_size=4, spec=SpecConfig(enabled=True, **spec))
    return LLMEngine(model, cfg, eos_token_ids=[VOCAB - 1])


def group_requests(n: int = 4) -> list[GenerateRequest]:
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [GenerateRequest([5, 6, 7, 8, 9, 10], p, request_id=f"r{i}", group_id=f"knob-{id(p)}") for i in range(n)]


def test_profile_file_is_measured_written_and_read(tmp_path: Path):
    path = tmp_path / "verify.json"
    eng = make_engine(profile_path=str(path))
    measured = json.loads(path.read_text())
    assert measured["batches"] == [1, 2, 4] and measured["positions"] == [0, 1, 2, 4]
    assert all(s > 0 for row in measured["seconds"] for s in row)
    assert eng.spec.length.profile.seconds == measured["seconds"]
    # a written profile where verifying costs 10x decoding: the engine decodes plainly
    path.write_text(json.dumps({"batches": [1, 4], "positions": [0, 4], "seconds": [[1.0, 10.0], [1.0, 10.0]]}))
    eng = make_engine(profile_path=str(path))
    reqs = group_requests(2)
    res = eng.generate(reqs[:1]) + eng.generate(reqs[1:])  # the second could draft from the first
    assert eng.spec.metrics.verify_steps == 0 and eng.spec.metrics.plain_steps > 0
    assert all(len(r.token_ids) == 24 for r in res)
    # a flat profile (verifying costs what decoding does): drafts are verified
    path.write_text(json.dumps({"batches": [1, 4], "positions": [0, 4], "seconds": [[1.0, 1.0], [1.0, 1.0]]}))
    eng = make_engine(profile_path=str(path))
    reqs = group_requests(2)
    eng.generate(reqs[:1])
    eng.generate(reqs[1:])
    assert eng.spec.metrics.verify_steps > 0


def test_num_tokens_bounds_the_draft_depth_and_adaptive_off_always_drafts():
    for k in (1, 3):
        eng = make_engine(adaptive=False, num_tokens=k)
        reqs = group_requests()
        eng.generate(reqs[:1])  # the first member's answer is in the group store
        eng.generate(reqs[1:])
        st = eng.stats_dict()
        assert len(st["spec_acceptance_per_position"]) == k
        assert st["spec_accepted_tokens"] > 0 and eng.spec.length.profile is None


def test_metrics_in_engine_stats_pool_rows_and_step_metrics():
    eng = make_engine(adaptive=False, num_tokens=4)
    reqs = group_requests()
    eng.generate(reqs[:1])
    eng.generate(reqs[1:])
    st = eng.stats_dict()
    m = eng.spec.metrics
    assert st["spec_drafts"] == m.drafts > 0
    assert st["spec_acceptance_rate"] == pytest.approx(m.accepted_tokens / m.draft_tokens)
    assert st["spec_mean_acceptance_length"] == pytest.approx(1 + m.accepted_tokens / m.drafts)
    assert st["spec_acceptance_per_position"][0] == pytest.approx(m.accepted_per_pos[0] / m.drafts)

    async def main():
        a = AsyncEngine(eng)
        pool = EnginePool([a])
        try:
            rows = pool.engine_rows()  # what GET /health lists per engine
            flat = pool.spec_stats()  # what the controller puts in step metrics (spec/...)
        finally:
            pool.shutdown()
        return rows, flat

    rows, flat = asyncio.run(main())
    assert rows[0]["spec_accepted_tokens"] == m.accepted_tokens
    assert flat["spec_mean_acceptance_length"] == pytest.approx(st["spec_mean_acceptance_length"])
    assert flat["spec_acceptance_pos1"] == pytest.approx(st["spec_acceptance_per_position"][0])
    assert all(isinstance(v, (int, float)) for v in flat.values())


def test_spec_off_by_default_and_unknown_drafter_is_a_clear_error():
    assert EngineConfig().spec.enabled is False
    model = tiny_llama(layers=1, hidden=32, vocab=64, heads=4, kv_heads=2)
    assert LLMEngine(model, EngineConfig(), eos_token_ids=[63]).spec_stats() == {}
    from arborl.registry import RegistryError
    with pytest.raises(RegistryError, match="unknown drafter 'nope'"):
        LLMEngine(model, EngineConfig(spec=SpecConfig(enabled=True, drafter="nope")), eos_token_ids=[63])
