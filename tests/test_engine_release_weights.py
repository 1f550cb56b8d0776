"""An idle engine told that the next weight update carries every weight (the full fine-tuning warm start)
frees its own copy of the weights: the packed Linear weights, its only copy when it owns its model. It
refuses requests until that update, refuses an update that leaves a packed weight out, and after a full
update serves exactly what it served before."""

from __future__ import annotations

import asyncio
import copy

import pytest

from arborl.config import EngineConfig
from arborl.engine import AsyncEngine, LLMEngine, WeightsReleasedError
from arborl.engine.pool import EnginePool
from arborl.models import tiny_llama
from arborl.types import ArborlError, GenerateRequest, SamplingParams

VOCAB = 96


def _model():
    return tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=3)


def _requests():
    return [GenerateRequest(list(range(5 + i, 17 + i)), SamplingParams(temperature=0.8, max_tokens=12, seed=i, ignore_eos=True),
                            request_id=f"r{i}") for i in range(3)]


def _packed_bytes(engine: LLMEngine) -> int:
    return sum(t.numel() * t.element_size() for w in engine.runner.linear.packed_groups().values()
               for t in (w.onednn, w.panels, w.bias, w.scales) if t is not None)


def test_released_weights_are_freed_refused_and_restored_by_a_full_update():
    policy = _model()
    engine = LLMEngine(copy.deepcopy(policy), EngineConfig(max_batch_size=4, max_seq_len=128), eos_token_ids=[],
                       owns_model=True)
    assert engine.runner.linear is not None and len(engine.runner.linear.held()) > 0  # the packs are its only copy
    before = [(r.token_ids, r.logprobs) for r in engine.generate(_requests())]
    packed = _packed_bytes(engine)

    freed = engine.release_memory(weights=True)
    assert freed >= packed > 0 and _packed_bytes(engine) == 0
    with pytest.raises(WeightsReleasedError, match="released its weights; it serves again after the next weight update"):
        engine.add_request(_requests()[0])

    state = policy.state_dict()
    partial = {k: v for k, v in state.items() if ".layers.0." in k}
    with pytest.raises(ArborlError, match="weight update must carry it"):
        engine.update_weights(partial, 1)
    with pytest.raises(WeightsReleasedError):  # still released: the failed update restored nothing
        engine.add_request(_requests()[0])

    engine.update_weights(state, 2)
    assert _packed_bytes(engine) == packed
    after = [(r.token_ids, r.logprobs) for r in engine.generate(_requests())]
    assert after == before


def test_a_plain_release_keeps_the_weights_and_the_pool_passes_weights_on():
    policy = _model()

    async def run():
        engines = [AsyncEngine(LLMEngine(copy.deepcopy(policy), EngineConfig(max_batch_size=4, max_seq_len=128, engine_id=f"e{i}"),
                                         eos_token_ids=[], owns_model=True)) for i in range(2)]
        try:
            pool = EnginePool(engines)
            first = await engines[0].generate(_requests()[0])
            await pool.release_memory()  # caches only: it still serves
            assert (await engines[0].generate(_requests()[0])).token_ids == first.token_ids
            packed = sum(_packed_bytes(e.engine) for e in engines)
            freed = await pool.release_memory(weights=True)
            assert freed >= packed > 0 and all(_packed_bytes(e.engine) == 0 for e in engines)
            with pytest.raises(WeightsReleasedError):
                await engines[1].generate(_requests()[0])
            await pool.update_weights(policy.state_dict(), 1)
            assert (await engines[1].generate(_requests()[0])).token_ids == first.token_ids
        finally:
            for e in engines:
                e.shutdown()

    asyncio.run(run())


def test_an_evaluation_leaves_no_cached_kv_behind(tmp_path):
    """The held-out episodes' prefix-cache KV is of no use to the training rollouts that follow: the engines
    release it when an evaluation ends with nothing else in flight (it had stayed through the next rollout,
    the code-repair job's peak)."""
    from arborl.config import load_config
    from arborl.run.assemble import build_gateway
    from arborl.run.controller import Controller
    from arborl.tasks import make_suite

    cfg = load_config(None, [
        "name=ev", f"runs_dir={tmp_path}", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1",
        "model.tiny_hidden=32", "engine.max_seq_len=256", "scheduling.timeline=false", "rollout.task=even_tokens",
        "rollout.max_tokens=4"])
    built = build_gateway(cfg)
    engines = [e.engine for e in built.engines.engines]

    async def body():
        ctl = Controller(cfg, built.gateway, built.engines, built.pool, None, make_suite(cfg.rollout))
        try:
            cached = []
            real = ctl.engines.release_memory

            async def seen(*a, **kw):  # what the caches held when the release came
                cached.append(sum(e.prefix_cache.cached_tokens for e in engines))
                return await real(*a, **kw)

            ctl.engines.release_memory = seen
            out = await ctl.evaluate(3)
            return out, cached
        finally:
            await ctl.close()

    try:
        out, cached = asyncio.run(body())
    finally:
        built.close()
    assert out["eval_s"] > 0 and cached and cached[-1] > 0  # the evaluation had filled the cache ...
    assert sum(e.prefix_cache.cached_tokens for e in engines) == 0  # ... and left it empty
