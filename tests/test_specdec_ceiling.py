"""The bench's noise-free replay of drafting (arborl_bench.specdec_ceiling) against the live engine:
with position-keyed sampling a draft's accepted count is its common prefix with the text, so replaying
the tabulated positions must give the engine's own drafts and accepted tokens, draft by draft."""

from __future__ import annotations

from dataclasses import replace

import pytest

from arborl_bench.specdec_ceiling import (
    RULES,
    Position,
    free_rows,
    position_table,
    replay,
)
from arborl.config import EngineConfig, SpecConfig
from arborl.engine import LLMEngine
from arborl.engine.specdec.adaptive import VerifyProfile
from arborl.engine.specdec.suffix import GroupStores
from arborl.models import tiny_llama
from arborl.types import GenerateRequest, SamplingParams

VOCAB = 64
K = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(spec: bool, stores: GroupStores | None = None) -> LLMEngine:
    model = tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=3)
    cfg = EngineConfig(max_seq_len=512, max_batch_size=4,
                       spec=SpecConfig(enabled=spec, adaptive=False, num_tokens=K, fallback_tokens=0))
    eng = LLMEngine(model, cfg, eos_token_ids=[VOCAB - 1])
    if spec and stores is not None:
        eng.spec.drafter.groups = stores
    return eng


def _req(seed: int, params: SamplingParams) -> GenerateRequest:
    return GenerateRequest([5, 6, 7, 8, 9, 10, 11], replace(params, seed=seed),
                           request_id=f"g/m{seed}", group_id="g")


def test_replay_reproduces_the_live_engines_drafts_and_accepted_tokens():
    params = SamplingParams(temperature=0.3, top_k=2, max_tokens=120, ignore_eos=True)
    stores = GroupStores(8)
    feeder = _engine(True, stores)
    feeder.spec.length.max_k = 0  # references: feed the group store, never draft
    feeder.generate([_req(s, params) for s in range(4)])
    # both sides draft from copies (copies index streams in one order: ties among votes break alike)
    reference_store = stores.copy()
    live = _engine(True, stores.copy())
    per_draft: list[int] = []
    record = live.spec.accepted

    def accepted(draft, n):  # the live engine's verdict on each draft, observed
        if len(draft):
            per_draft.append(n)
        record(draft, n)

    live.spec.accepted = accepted
    (res,) = live.generate([_req(100, params)])
    st = live.stats_dict()
    # the check means something only if drafts were both accepted and rejected (here 47 drafts, 18 tokens accepted)
    assert st["spec_drafts"] >= 10 and 10 <= st["spec_accepted_tokens"] < K * st["spec_drafts"]

    spec_cfg = live.config.spec
    table = position_table(live.runner.model, res, reference_store.get("g", spec_cfg.min_match), spec_cfg, K,
                           frozenset())  # ignore_eos: no stop token cuts a draft
    assert len(table) == len(res.token_ids) - 1  # one position per decode step of the plain engine
    flat = VerifyProfile([1, 2], [0, K], [[1.0, 1.0], [1.0, 1.0]])
    got = replay([table], flat, 1, RULES["suffix"])
    assert (got["drafts"], got["accepted"]) == (st["spec_drafts"], st["spec_accepted_tokens"])
    assert got["accepted_per_draft"] == per_draft  # draft by draft, in order
    assert got["tokens"] == len(res.token_ids) - 1
    # the plain engine samples the very text the speculative one emitted (the premise of the replay)
    (plain,) = _engine(False).generate([_req(100, params)])
    assert plain.token_ids == res.token_ids


def test_replay_ratios_follow_the_cost_of_verify_rows():
    # two sequences of 9 decode steps; the first always accepts 2 drafted tokens, the second none
    good = [Position(drafted=3, accepted=2, greedy_run=2)] * 9
    bad = [Position(drafted=3, accepted=0, greedy_run=1)] * 9
    costly = VerifyProfile([1, 2], [0, 3], [[1.0, 2.0], [1.0, 2.0]])  # 3 draft rows double a step
    # batch 1, free rows: 9 steps plain vs 3 (good: 3 tokens a step) + 9 (bad) speculative
    assert replay([good, bad], free_rows(costly), 1, RULES["suffix"])["ratio"] == pytest.approx(18 / 12)
    # the oracle verifies only what is accepted: bad costs nothing extra, good's 2 rows cost 1 + 2/3
    oracle = replay([good, bad], costly, 1, RULES["suffix_oracle"])
    assert oracle["ratio"] == pytest.approx((18 / (3 * (1 + 2 / 3) + 9)) / (18 / 18))
    # verifying every draft whole: bad's 3 rejected rows double most of its steps, a loss
    assert replay([good, bad], costly, 1, RULES["suffix"])["ratio"] < 1.0 < oracle["ratio"]
    # batch 2: the wave lasts as long as its slowest member (bad never gains), so no speed-up is left
    assert replay([good, bad], free_rows(costly), 2, RULES["suffix"])["ratio"] == pytest.approx(1.0)
    assert replay([good, bad], free_rows(costly), 2, RULES["greedy_oracle"])["ratio"] > 1.0
