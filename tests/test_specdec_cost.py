"""The adaptive rule's cost side: a k > 0 must beat plain decoding by a margin (never a loss near
break-even), and the acceptance walk's time per sequence, measured by the engine, counts. ~2 s."""

from __future__ import annotations

import json

import pytest

from arborl.config import EngineConfig, SpecConfig
from arborl.engine import LLMEngine
from arborl.engine.specdec import adaptive
from arborl.engine.specdec.adaptive import MIN_GAIN, AdaptiveLength, VerifyProfile, monotone
from arborl.models import tiny_llama
from arborl.types import GenerateRequest, SamplingParams

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is faster


def flat(step: float) -> VerifyProfile:
    """T(B, n) = 1 + step * n at every batch."""
    positions = [0, 1, 2, 4]
    return VerifyProfile([1, 32], positions, [[1.0 + step * n for n in positions]] * 2)


def test_near_break_even_stays_plain():
    # k = 1 expects 1.6 tokens for 1.55x the time: +3%, inside the margin -> plain decoding
    length = AdaptiveLength(max_k=1, prior=0.6, profile=flat(0.55))
    assert 1.0 < length.tokens_per_s(32, 1) / length.tokens_per_s(32, 0) < MIN_GAIN
    assert length.choose(32) == 0
    # a clear gain still speculates
    assert AdaptiveLength(max_k=1, prior=0.6, profile=flat(0.3)).choose(32) == 1


def test_acceptance_walk_time_counts():
    length = AdaptiveLength(max_k=4, prior=0.6, profile=flat(0.1))
    assert length.choose(8) > 0
    length.record_accept_time(8 * 0.5, 8)  # half a forward per sequence spent walking drafts
    assert length.accept_s_per_seq == pytest.approx(0.5)
    assert length.choose(8) == 0
    assert AdaptiveLength(max_k=0, prior=0.6, profile=flat(0.1)).choose(8) == 0  # no draft positions at all


def test_engine_measures_the_walk_per_sequence(tmp_path):
    model = tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    cheap = VerifyProfile([1, 4], [0, 1, 2, 4], [[1.0, 1.0, 1.0, 1.0]] * 2)  # verifying is free: always draft
    (tmp_path / "profile.json").write_text(json.dumps(cheap.to_json()))
    spec = SpecConfig(enabled=True, num_tokens=4, profile_path=str(tmp_path / "profile.json"))
    eng = LLMEngine(model, EngineConfig(max_seq_len=256, max_batch_size=4, spec=spec), eos_token_ids=[VOCAB - 1])
    assert eng.spec.length.accept_s_per_seq == 0.0
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for _ in range(2):  # greedy: the second member drafts the first's tokens from the group store
        eng.generate([GenerateRequest([5, 6, 7, 8], p, group_id=f"walk-{id(eng)}")])
    assert eng.spec_stats()["spec_verify_steps"] > 0
    assert 0.0 < eng.spec.length.accept_s_per_seq < 1.0


def test_positions_past_the_verified_k_are_censored_not_rejected():
    length = AdaptiveLength(max_k=4, prior=0.6, profile=flat(0.1))
    for _ in range(300):  # verified at k = 1 and always accepted; the drafter had 4 tokens each time
        length.record(1, verified=1, depth=4, asked=4)
    a = length.acceptance()
    assert a[0] > 0.95 and a[1] == pytest.approx(0.36)  # position 2 was never tried: still the prior
    assert length.choose(1) > 1  # so longer drafts are still tried
    # a drafter that only ever has 1 token: the positions past it are zeros whatever k was verified
    short = AdaptiveLength(max_k=4, prior=0.6, profile=flat(0.1))
    for _ in range(300):
        short.record(1, verified=1, depth=1, asked=4)
    assert short.acceptance()[1] < 0.05 and short.choose(1) == 1
    # the old reading (every position observed) drives them to zero: what the censoring prevents
    naive = AdaptiveLength(max_k=4, prior=0.6, profile=flat(0.1))
    for _ in range(300):
        naive.record(1)
    assert naive.acceptance()[1] < 0.05


def test_packed_verify_is_costed_by_the_drafts_it_holds():
    # the kernel's verify packs trees without padding: two 4-node drafts among 4 sequences cost 2 nodes
    # per sequence on average, not 4
    length = AdaptiveLength(max_k=4, prior=0.8, profile=flat(0.5))
    padded, packed = length.tokens_per_s(4, 4, 0.5), length.tokens_per_s(4, 4, 0.5, sizes=[4, 4, 0, 0])
    assert packed / padded == pytest.approx((1 + 0.5 * 4) / (1 + 0.5 * 2))
    assert length.choose(4, 0.5) == 0 and length.choose(4, 0.5, sizes=[4, 4, 0, 0]) == 2  # the best k packed


def test_profile_is_timed_in_passes_over_the_grid_and_made_monotone(tmp_path, monkeypatch):
    """A busy spell slows the cells timed during it in one pass, not every timing of one cell: the
    fastest of the passes holds. What noise still leaves is made non-decreasing in batch and in
    positions by pooling (T(2, 0) above T(4, 0) turned speculation off at batch 4 and on at batch 3)."""
    calls: list[tuple[int, int]] = []
    busy = {(2, 0): 3}  # (B, n) -> the call (counting from 1) of that cell that the busy spell hits

    now = [0.0]  # the profile's clock: each call advances it by its cost, so a loaded machine changes nothing

    def run(b: int, n: int) -> None:
        calls.append((b, n))
        slow = busy.get((b, n)) == calls.count((b, n))
        now[0] += 0.02 if slow else 0.001 * b * (1 + n)

    with monkeypatch.context() as m:
        m.setattr(adaptive.time, "perf_counter", lambda: now[0])
        prof = VerifyProfile.measure(run, [1, 2, 4], [0, 1], rounds=3)
    assert calls[:6] == calls[6:12] == calls[12:18] == [(1, 0), (1, 1), (2, 0), (2, 1), (4, 0), (4, 1)]
    assert prof.seconds[1][0] == pytest.approx(0.002)  # the slow call of (2, 0) is not what the profile holds
    noisy = [[1.0, 2.0, 1.5], [3.0, 2.0, 4.0], [2.0, 5.0, 6.0]]
    fixed = monotone(noisy)
    assert all(a <= b for row in fixed for a, b in zip(row, row[1:]))
    assert all(a <= b for col in zip(*fixed) for a, b in zip(col, col[1:]))
    assert fixed[0] == [1.0, 1.75, 1.75] and fixed[2][2] == 6.0  # violators are averaged, the rest kept
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"batches": [1, 2, 4], "positions": [0, 1, 2], "seconds": noisy}))
    assert VerifyProfile.load(path).seconds == fixed  # an old (or hand-written) file is made monotone too
