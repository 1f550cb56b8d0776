"""The built-in engine against a plain transformers forward on the same weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from arborl.config import EngineConfig
from arborl.engine import AsyncEngine, LLMEngine, TokenEvent
from arborl.models import tiny_llama
from arborl.types import ArborlError, FinishReason, GenerateRequest, InvalidRequestError, SamplingParams

VOCAB = 512
EOS = VOCAB - 1


def make_model(seed: int = 0):
    return tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=seed)


def make_engine(model=None, **cfg) -> LLMEngine:
    cfg.setdefault("max_seq_len", 256)
    cfg.setdefault("max_batch_size", 8)
    return LLMEngine(model if model is not None else make_model(), EngineConfig(**cfg), eos_token_ids=[EOS])


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()


@torch.no_grad()
def reference_logprobs(model, prompt_ids: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) from one plain HF forward, temperature 1."""
    ids = torch.tensor([prompt_ids + output])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(output) - 1)
    return logp[pos, torch.tensor(output)]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_matches_reference(model, res, atol=1e-4):
    ref = reference_logprobs(model, res.prompt_token_ids, res.token_ids)
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=atol), (res.logprobs, ref.tolist())
    # greedy: every token is the argmax of the reference distribution
    ids = torch.tensor([res.prompt_token_ids + res.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0]
    n = len(res.prompt_token_ids)
    expect = logits[n - 1 : n - 1 + len(res.token_ids)].argmax(-1).tolist()
    assert res.token_ids == expect


def test_greedy_batch_equals_transformers_forward():
    model = make_model()
    eng = make_engine(model)
    reqs = [GenerateRequest(prompt(i, n), greedy(10 + i)) for i, n in enumerate([5, 17, 33, 9, 60])]
    results = eng.generate(reqs)
    for req, res in zip(reqs, results):
        assert len(res.token_ids) == req.params.max_tokens
        assert res.finish_reason == FinishReason.LENGTH
        assert res.versions == [0] * len(res.token_ids)
        assert res.sample_logprobs == [0.0] * len(res.token_ids)
        assert_matches_reference(model, res)
    assert eng.stats.max_batch_size == 5


def test_prefix_cache_hit_is_exact():
    model = make_model()
    eng = make_engine(model)
    shared = prompt(1, 40)
    first = eng.generate([GenerateRequest(shared + [3, 4], greedy(8))])[0]
    assert first.cached_prompt_tokens == 0
    # second turn extends the first call's prompt + completion: nearly all of it is cached
    turn2 = first.prompt_token_ids + first.token_ids + [7, 8, 9]
    second = eng.generate([GenerateRequest(turn2, greedy(8))])[0]
    assert second.cached_prompt_tokens >= len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert_matches_reference(model, second)
    # a sibling sharing only the 40-token prefix reuses exactly that
    third = eng.generate([GenerateRequest(shared + [11, 12], greedy(8))])[0]
    assert third.cached_prompt_tokens == 40
    assert_matches_reference(model, third)
    assert 0 < eng.stats_dict()["cache_hit_rate"] < 1


def test_prefix_cache_respects_budget_and_can_be_off():
    eng = make_engine(prefix_cache_tokens=50)
    for i in range(6):
        eng.generate([GenerateRequest(prompt(100 + i, 30), greedy(5))])
    assert eng.prefix_cache.cached_tokens <= 50
    off = make_engine(prefix_cache=False)
    p = prompt(7, 30)
    off.generate([GenerateRequest(p, greedy(3))])
    assert off.generate([GenerateRequest(p, greedy(3))])[0].cached_prompt_tokens == 0


def test_weight_update_mid_request_stamps_versions_and_matches_new_policy():
    old = make_model(seed=0)
    new = make_model(seed=1)
    eng = make_engine(make_model(seed=0))
    req = GenerateRequest(prompt(3, 20), greedy(12))
    seq = eng.add_request(req)
    for _ in range(3):
        assert not eng.step()
    before = len(seq.output)  # tokens made by version 0
    assert 0 < before < 12
    eng.update_weights(new.state_dict(), version=1)
    res = eng.run_until_done()[0]
    assert res.versions == [0] * before + [1] * (12 - before)
    full = res.prompt_token_ids + res.token_ids
    ref_old = reference_logprobs(old, res.prompt_token_ids, res.token_ids[:before])
    ref_new = reference_logprobs(new, full[: len(res.prompt_token_ids) + before], res.token_ids[before:])
    got = torch.tensor(res.logprobs)
    assert torch.allclose(got[:before], ref_old, atol=1e-4)
    assert torch.allclose(got[before:], ref_new, atol=1e-4)
    assert eng.prefix_cache.cached_tokens > 0  # refilled under the new policy only
    again = eng.generate([GenerateRequest(full[:30], greedy(4))])[0]
    assert_matches_reference(new, again)


def test_continuous_batching_admits_into_running_batch():
    eng = make_engine(max_batch_size=2)
    a = eng.add_request(GenerateRequest(prompt(1, 8), greedy(3)))
    b = eng.add_request(GenerateRequest(prompt(2, 8), greedy(20)))
    c = eng.add_request(GenerateRequest(prompt(3, 8), greedy(5)))
    eng.step()
    assert eng.num_running == 2 and eng.num_waiting == 1
    done = []
    while a.request_id not in done:
        done += [r.request_id for r in eng.step()]
    assert c.state.value == "waiting"
    done += [r.request_id for r in eng.step()]
    assert c.state.value != "waiting"  # admitted into the running batch at the very next step
    assert eng.num_running == 2 or c.request_id in done
    while eng.has_work:
        done += [r.request_id for r in eng.step()]
    assert done.index(a.request_id) < done.index(c.request_id) < done.index(b.request_id)
    assert eng.stats.max_batch_size == 2


def test_priority_runs_first():
    eng = make_engine(max_batch_size=1)
    low = GenerateRequest(prompt(1, 5), greedy(2))
    high = GenerateRequest(prompt(2, 5), greedy(2), priority=5)
    eng.add_request(low)
    eng.add_request(high)
    order = [r.request_id for r in eng.run_until_done()]
    assert order == [high.request_id, low.request_id]


def test_stops_and_limits():
    model = make_model()
    eng = make_engine(model)
    base = eng.generate([GenerateRequest(prompt(5, 10), greedy(10))])[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    r = eng.generate([GenerateRequest(prompt(5, 10), greedy(10, stop_token_ids=[stop_tok]))])[0]
    assert r.finish_reason == FinishReason.STOP and r.token_ids == base.token_ids[: first + 1]
    # EOS stops unless ignore_eos
    eos_eng = LLMEngine(model, EngineConfig(max_seq_len=256), eos_token_ids=[stop_tok])
    r = eos_eng.generate([GenerateRequest(prompt(5, 10), SamplingParams(temperature=0, max_tokens=10))])[0]
    assert r.finish_reason == FinishReason.STOP and len(r.token_ids) == first + 1
    r = eos_eng.generate([GenerateRequest(prompt(5, 10), greedy(10))])[0]
    assert r.token_ids == base.token_ids
    # context limit
    small = make_engine(model, max_seq_len=16)
    r = small.generate([GenerateRequest(prompt(5, 10), greedy(50))])[0]
    assert r.finish_reason == FinishReason.LENGTH and len(r.prompt_token_ids) + len(r.token_ids) == 16


def test_abort_returns_partial_output():
    eng = make_engine()
    req = GenerateRequest(prompt(1, 8), greedy(100))
    waiting = GenerateRequest(prompt(2, 8), greedy(100))
    eng.add_request(req)
    eng.step()
    eng.step()
    eng.abort(req.request_id)
    eng.add_request(waiting)
    eng.abort(waiting.request_id)
    res = {r.request_id: r for r in eng.step()}
    assert res[req.request_id].finish_reason == FinishReason.ABORT
    assert 0 < len(res[req.request_id].token_ids) < 100
    assert res[waiting.request_id].finish_reason == FinishReason.ABORT
    assert not eng.has_work and eng.stats.aborted == 2


def test_sampling_seed_is_independent_of_batch():
    eng = make_engine()
    p = SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True, seed=123)
    alone = eng.generate([GenerateRequest(prompt(1, 12), p)])[0]
    others = [GenerateRequest(prompt(9 + i, 7), SamplingParams(temperature=0.7, max_tokens=9)) for i in range(3)]
    crowd = eng.generate(others + [GenerateRequest(prompt(1, 12), p)])[-1]
    assert alone.token_ids == crowd.token_ids
    # temperature 1 without truncation: the sampling distribution is the raw policy
    assert torch.allclose(torch.tensor(alone.sample_logprobs), torch.tensor(alone.logprobs), atol=1e-5)


def test_temperature_and_truncation_logprobs():
    model = make_model()
    eng = make_engine(model)
    p = prompt(4, 10)
    r = eng.generate([GenerateRequest(p, SamplingParams(temperature=0.5, top_k=5, max_tokens=8, seed=1, ignore_eos=True))])[0]
    with torch.no_grad():
        logits = model(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1 : -1]
    top5 = torch.topk(logits, 5, dim=-1).indices
    for i, tok in enumerate(r.token_ids):
        assert tok in top5[i].tolist()
        scaled = logits[i] / 0.5
        kept = torch.full_like(scaled, float("-inf"))
        kept[top5[i]] = scaled[top5[i]]
        assert abs(torch.log_softmax(kept, -1)[tok].item() - r.sample_logprobs[i]) < 1e-4
    assert_close = torch.allclose(torch.tensor(r.logprobs), reference_logprobs(model, p, r.token_ids), atol=1e-4)
    assert assert_close
    top1 = eng.generate([GenerateRequest(p, SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True))])[0]
    assert top1.token_ids == eng.generate([GenerateRequest(p, greedy(8))])[0].token_ids
    assert top1.sample_logprobs == pytest.approx([0.0] * 8, abs=1e-6)
    nucleus = eng.generate([GenerateRequest(p, SamplingParams(top_p=0.3, max_tokens=8, seed=2, ignore_eos=True))])[0]
    assert all(lp <= 0.0 for lp in nucleus.sample_logprobs)


@pytest.mark.parametrize(
    "req, msg",
    [
        (GenerateRequest([], greedy()), "empty"),
        (GenerateRequest([VOCAB + 3], greedy()), "outside"),
        (GenerateRequest(list(range(300)), greedy()), "context"),
        (GenerateRequest([1, 2], SamplingParams(temperature=-1)), "temperature"),
        (GenerateRequest([1, 2], SamplingParams(top_p=0)), "top_p"),
        (GenerateRequest([1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
        (GenerateRequest([1, 2], SamplingParams(stop=["x"])), "tokenizer"),
    ],
)
def test_invalid_requests_are_rejected(req, msg):
    eng = make_engine()
    with pytest.raises(InvalidRequestError, match=msg):
        eng.add_request(req)
    assert not eng.has_work


def test_async_engine_concurrent_stream_cancel_and_update():
    model = make_model()

    async def main():
        aeng = AsyncEngine(make_engine(model))
        try:
            reqs = [GenerateRequest(prompt(i, 6 + i), greedy(6)) for i in range(4)]
            results = await asyncio.gather(*(aeng.generate(r) for r in reqs))
            for r in results:
                assert_matches_reference(model, r)
            events = [ev async for ev in aeng.stream(GenerateRequest(reqs[1].prompt_token_ids, greedy(5)))]
            assert [type(e) for e in events[:-1]] == [TokenEvent] * 5
            assert [e.token_id for e in events[:-1]] == events[-1].token_ids == results[1].token_ids[:5]
            with pytest.raises(InvalidRequestError):
                await aeng.generate(GenerateRequest([], greedy()))
            long = GenerateRequest(prompt(2, 6), greedy(200))
            task = asyncio.ensure_future(aeng.generate(long))
            await asyncio.wait_for(aeng.pause(after_tokens=1), 60)  # in flight, whatever the machine's speed
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await until(aeng, lambda st: st["running"] == 0)  # the abort ends it while paused
            assert stats["aborted"] == 1
            aeng.resume()
            new = make_model(seed=3)
            await aeng.update_weights(new.state_dict(), 7)
            assert aeng.version == 7
            after = await aeng.generate(GenerateRequest(prompt(1, 6), greedy(3)))
            assert after.versions == [7, 7, 7]
            assert_matches_reference(new, after)  # served by the new weights, not only stamped 7
        finally:
            aeng.shutdown()

    asyncio.run(main())


def test_bad_weight_update_is_rejected_and_engine_keeps_serving():
    eng = make_engine()
    with pytest.raises(Exception, match="unknown parameter"):
        eng.update_weights({"nope.weight": torch.zeros(1)}, 1)
    with pytest.raises(Exception, match="shape"):
        eng.update_weights({"lm_head.weight": torch.zeros(3, 3)}, 1)
    assert eng.version == 0
    assert eng.generate([GenerateRequest(prompt(1, 5), greedy(2))])[0].versions == [0, 0]


def test_group_prompts_prefill_once_and_long_prompts_split_across_forwards():
    model = make_model()
    eng = make_engine(model, prefill_chunk_tokens=16, max_batch_size=16)
    group = prompt(21, 40)
    others = [prompt(30 + i, 10 + 7 * i) for i in range(3)]  # 10, 17, 24 tokens: split over forwards
    reqs = [GenerateRequest(group, greedy(5)) for _ in range(8)] + [GenerateRequest(p, greedy(5)) for p in others]
    results = eng.generate(reqs)
    cached = sorted(r.cached_prompt_tokens for r in results[:8])
    assert cached == [0] + [39] * 7  # one member prefills, the group reuses it in the same step
    assert len({tuple(r.token_ids) for r in results[:8]}) == 1
    for r in results[7:]:
        assert_matches_reference(model, r)
    no_defer = make_engine(model, inbatch_prefix_min_tokens=0)
    assert sum(r.cached_prompt_tokens for r in no_defer.generate(reqs[:8])) == 0


def test_kv_capacity_grows_past_its_first_allocation():
    model = make_model()
    eng = make_engine(model, max_seq_len=1024)
    start_capacity = eng.runner.kv.capacity
    short = GenerateRequest(prompt(40, 20), greedy(4))
    long = GenerateRequest(prompt(41, start_capacity - 3), greedy(10))  # decodes across the boundary
    results = eng.generate([short, long])
    assert eng.runner.kv.capacity > start_capacity
    for r in results:
        assert_matches_reference(model, r)


def test_kv_slots_grow_with_the_sequences_running_not_the_batch_allowed():
    """The KV holds rows for the sequences that ran at once (doubling), never max_batch_size's unless that many
    ran; a batch that grows the rows mid-run gives the tokens each request gives alone."""
    model = make_model()
    eng = make_engine(model, max_batch_size=32, max_seq_len=256)
    eng.generate([GenerateRequest(prompt(60, 9), greedy(3)) for _ in range(2)])
    assert eng.runner.kv.slots == 4 and eng.runner.kv.max_slots == 32
    reqs = [GenerateRequest(prompt(61 + i, 5 + i), greedy(6)) for i in range(11)]
    for r in eng.generate(reqs):
        assert_matches_reference(model, r)
    assert 11 <= eng.runner.kv.slots <= 16  # the 11 that ran together, not 32
    with pytest.raises(ValueError, match="max_batch_size"):
        eng.runner.kv.ensure(8, 33)


def test_kv_growth_holds_one_layer_more_than_the_grown_cache_not_old_and_new(monkeypatch):
    """Growing the rows and the capacity allocates layer by layer and drops each old layer once copied: the
    KV alive at any allocation is at most the grown cache plus one layer (one tensor for all layers held the
    old cache and the new one together), and every sequence's KV survives the growth unchanged."""
    from arborl.engine import kv_cache

    model = tiny_llama(layers=6, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=0)
    eng = make_engine(model, max_batch_size=32, max_seq_len=1024)
    kv = eng.runner.kv
    eng.generate([GenerateRequest(prompt(70 + i, 200 + i), greedy(3)) for i in range(4)])
    before = [kv.read(s, 0, 200) for s in range(4)]
    real_zeros, alive = kv_cache._zeros, []

    def counting_zeros(shape, dtype, device):
        t = real_zeros(shape, dtype, device)
        alive.append(kv.nbytes + t.nbytes)  # the cache's layers now (some old, some new) and the new one
        return t

    monkeypatch.setattr(kv_cache, "_zeros", counting_zeros)
    old = kv.nbytes
    kv.ensure(2 * kv.capacity, 2 * kv.slots)
    grown = kv.nbytes
    assert len(alive) == kv.num_layers and grown == 4 * old
    assert max(alive) <= grown + grown // kv.num_layers < old + grown
    for s in range(4):
        assert torch.equal(kv.read(s, 0, 200), before[s])


def test_release_memory_frees_an_idle_engines_caches_and_nothing_of_a_busy_one():
    model = make_model()
    eng = make_engine(model, max_batch_size=16, max_seq_len=512)
    reqs = [GenerateRequest(prompt(70 + i, 300), greedy(4)) for i in range(9)]
    eng.generate(reqs)
    kv_before, cached = eng.runner.kv.nbytes, eng.prefix_cache.nbytes()
    assert cached > 0 and eng.runner.kv.slots >= 9
    eng.add_request(GenerateRequest(prompt(90, 20), greedy(2)))  # waiting: the engine is not idle
    assert eng.release_memory() == 0 and eng.prefix_cache.nbytes() == cached
    eng.run_until_done()
    cached = eng.prefix_cache.nbytes()
    freed = eng.release_memory()
    assert freed == cached + kv_before - eng.runner.kv.nbytes and eng.runner.kv.slots == 4
    assert eng.prefix_cache.nbytes() == 0 and eng.runner.kv.capacity == 256
    for r in eng.generate(reqs[:6]):  # the rows and capacity grow again, the tokens are the same
        assert_matches_reference(model, r)


def test_released_prefix_kv_is_freed_at_once_not_at_the_next_full_garbage_collection():
    """The cached KV that release_memory (and every weight update) drops is freed when dropped: with the
    cycle collector off, no piece survives (a parent/child cycle in the tree kept 0.5 GB of a code-repair
    evaluation split alive until a full collection, split after split)."""
    import gc
    import weakref

    eng = make_engine(max_batch_size=8, max_seq_len=512)
    base = prompt(95, 120)
    eng.generate([GenerateRequest(base + prompt(96 + i, 30), greedy(4)) for i in range(4)])
    pieces = [weakref.ref(n.value) for n in eng.prefix_cache.tree.dfs() if n.value is not None]
    assert len(pieces) >= 5  # the shared 120 tokens split off the four prompts' own tails
    gc.disable()
    try:
        assert eng.release_memory() > 0
        assert [p() for p in pieces] == [None] * len(pieces)
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie", [False, True])
def test_an_engine_owning_its_model_keeps_linear_weights_only_in_its_packs(dtype, tie):
    """owns_model: the packed copies are the engine's only copy of the Linear weights (a tied LM head stays: the
    embedding reads it); it samples what an engine keeping them samples, before and after a weight update."""
    import copy

    from arborl.models.quantize import to_serving_dtype

    if dtype == "bfloat16":
        from arborl.models.quantize import cpu_has_bf16

        if not cpu_has_bf16():
            pytest.skip("this CPU has no bfloat16 dot products: the bf16 copy stays float32")
    model = tiny_llama(layers=2, hidden=64, vocab=96, heads=4, kv_heads=2, seed=4, tie_embeddings=tie)
    cfg = EngineConfig(max_seq_len=128, max_batch_size=4)
    keep = LLMEngine(to_serving_dtype(copy.deepcopy(model), dtype), cfg, eos_token_ids=[])
    own = LLMEngine(to_serving_dtype(copy.deepcopy(model), dtype), cfg, eos_token_ids=[], owns_model=True)
    if own.runner.linear is None:
        pytest.skip("no packed weights on this machine")
    linear_bytes = {e: sum(m.weight.nbytes for m in e.model.modules() if isinstance(m, torch.nn.Linear))
                    for e in (keep, own)}
    head = own.model.lm_head.weight.nbytes if tie else 0
    assert own.runner.linear.held() and linear_bytes[own] == head < linear_bytes[keep]
    reqs = [GenerateRequest([1 + i, 7, 9, 3], SamplingParams(temperature=1.0, max_tokens=6, seed=i, ignore_eos=True))
            for i in range(3)]

    def same() -> None:
        a, b = keep.generate(reqs), own.generate(reqs)
        assert [r.token_ids for r in a] == [r.token_ids for r in b] and [r.logprobs for r in a] == [r.logprobs for r in b]

    same()
    state = tiny_llama(layers=2, hidden=64, vocab=96, heads=4, kv_heads=2, seed=5, tie_embeddings=tie).state_dict()
    keep.update_weights(state, 1)
    own.update_weights(state, 1)
    same()
    # a partial update (the MLPs left out) keeps the packs of what it leaves out
    partial = {k: v for k, v in tiny_llama(layers=2, hidden=64, vocab=96, heads=4, kv_heads=2, seed=6,
                                           tie_embeddings=tie).state_dict().items() if "mlp" not in k}
    keep.update_weights(partial, 2)
    own.update_weights(partial, 2)
    same()
    with pytest.raises(ArborlError, match="bias without its weight"):
        own.update_weights({"model.layers.0.mlp.down_proj.bias": torch.zeros(64)}, 3)


def test_slot_compaction_after_kv_growth():
    """A sequence leaving after the KV grew moves the last slot into its place (regression)."""
    model = make_model()
    eng = make_engine(model, max_seq_len=1024)
    cap = eng.runner.kv.capacity
    reqs = [GenerateRequest(prompt(50, cap + 5), greedy(2)), GenerateRequest(prompt(51, 12), greedy(9))]
    for r in eng.generate(reqs):
        assert_matches_reference(model, r)


async def until(aeng: AsyncEngine, cond, timeout: float = 60.0) -> dict:
    """The engine's stats once ``cond(stats)`` holds (each look is a command run between two steps)."""
    async def poll() -> dict:
        while not cond(stats := await aeng.stats()):
            await asyncio.sleep(0.005)
        return stats

    return await asyncio.wait_for(poll(), timeout)


def test_pause_holds_a_request_in_flight_and_commands_still_apply():
    """pause(after_tokens=k) stops decoding once k tokens came out; while paused no token is made, a
    new request waits, a weight update loads and an abort ends its request at once with its tokens;
    resume goes on. The point at which it pauses is an event, not a matter of the machine's speed."""
    aeng = AsyncEngine(make_engine())
    try:
        asyncio.run(_pause_scenario(aeng))
    finally:
        aeng.shutdown()


async def _pause_scenario(aeng: AsyncEngine) -> None:
    assert await asyncio.wait_for(aeng.pause(), 10) == 0 and aeng.paused  # idle: paused at once
    waiting = asyncio.ensure_future(aeng.generate(GenerateRequest(prompt(5, 6), greedy(4))))
    st = await until(aeng, lambda st: st["queue_length"] == 1)
    assert st["generated_tokens"] == 0 and st["paused"]
    aeng.resume()
    assert len((await waiting).token_ids) == 4 and not aeng.paused
    with pytest.raises(ValueError, match="after_tokens"):
        await aeng.pause(after_tokens=-1)

    req = GenerateRequest(prompt(6, 6), greedy(200))
    long = asyncio.ensure_future(aeng.generate(req))
    at = await asyncio.wait_for(aeng.pause(after_tokens=7), 60)
    assert at >= 4 + 7
    a, b = await aeng.stats(), await aeng.stats()
    assert a["generated_tokens"] == b["generated_tokens"] == at and a["running"] == 1 and a["paused"]
    await aeng.update_weights(make_model(seed=9).state_dict(), 1)  # loads while paused
    aeng.abort(req.request_id)  # ends at once, with the tokens it had
    res = await asyncio.wait_for(long, 60)
    assert res.finish_reason == FinishReason.ABORT and len(res.token_ids) == at - 4 and aeng.paused
    aeng.resume()
    after = await aeng.generate(GenerateRequest(prompt(1, 6), greedy(3)))
    assert after.versions == [1, 1, 1]


def test_caller_loop_closed_mid_request_does_not_kill_the_engine():
    aeng = AsyncEngine(make_engine())
    try:
        async def leave_early():
            asyncio.ensure_future(aeng.generate(GenerateRequest(prompt(1, 6), greedy(60))))
            await asyncio.wait_for(aeng.pause(after_tokens=1), 60)  # the loop closes with the request in flight

        asyncio.run(leave_early())

        async def later():
            aeng.resume()
            return await aeng.generate(GenerateRequest(prompt(2, 6), greedy(3)))

        assert len(asyncio.run(later()).token_ids) == 3
        assert not aeng.closed
    finally:
        aeng.shutdown()
    assert aeng.closed


class HeldEngineThread:
    """Keeps the engine's worker thread busy until released, through the public API: a weight update
    whose load blocks on an event (every call queued behind it waits). ``entered`` says it is inside."""

    def __init__(self, aeng: AsyncEngine) -> None:
        import threading

        self.entered, self.release = threading.Event(), threading.Event()
        aeng.engine.update_weights = lambda state, version: (self.entered.set(), self.release.wait(60))
        self.done = asyncio.ensure_future(aeng.update_weights({}, aeng.version))

    async def inside(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 60)


def test_shutdown_fails_queued_calls_instead_of_hanging():
    import threading

    aeng = AsyncEngine(make_engine())

    async def main():
        held = HeldEngineThread(aeng)
        await held.inside()
        pending = asyncio.ensure_future(aeng.stats())
        await asyncio.sleep(0)  # the stats call is queued behind the held thread
        closer = threading.Thread(target=aeng.shutdown)
        closer.start()
        while not aeng.closed:
            await asyncio.sleep(0.001)
        held.release.set()
        with pytest.raises(Exception, match="shut down"):
            await asyncio.wait_for(pending, 10)
        await asyncio.to_thread(closer.join, 30)

    asyncio.run(main())


def test_request_cancelled_before_the_engine_took_it_is_aborted():
    aeng = AsyncEngine(make_engine())
    try:
        async def main():
            held = HeldEngineThread(aeng)  # the add below waits behind this
            await held.inside()
            task = asyncio.ensure_future(aeng.generate(GenerateRequest(prompt(3, 6), greedy(200))))
            await asyncio.sleep(0)  # its add is queued
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            held.release.set()
            await held.done
            return await until(aeng, lambda st: st["aborted"] == 1 and st["running"] == 0)

        stats = asyncio.run(main())
        assert stats["aborted"] == 1 and stats["running"] == 0 and stats["generated_tokens"] == 0
    finally:
        aeng.shutdown()
