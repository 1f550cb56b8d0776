"""tests/pace.py, the fast/slow modes that prove no test races the clock: a stretched wait asks the real
clock for factor x longer, only in the module it was given to; the slow engine sleeps before each step
and still gives the same tokens."""

from __future__ import annotations

import asyncio
import time
import types

import pace


def test_stretched_waits_reach_only_the_module_they_were_given_to(monkeypatch):
    asked: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: asked.append(s))
    real_async_sleep = asyncio.sleep

    async def fake_async_sleep(delay, result=None):
        asked.append(delay)
        return result

    monkeypatch.setattr(asyncio, "sleep", fake_async_sleep)
    monkeypatch.setenv("ARBORL_TEST_PACE_FACTOR", "20")
    mod = types.ModuleType("some_test")
    mod.time, mod.asyncio, mod.other = time, asyncio, 1
    pace.stretch_test_waits(mod)
    mod.time.sleep(0.05)
    assert real_async_sleep is not fake_async_sleep
    assert asyncio.run(mod.asyncio.sleep(0.1, result="r")) == "r"
    assert asked == [1.0, 2.0]
    assert mod.time.monotonic is time.monotonic and mod.asyncio.Event is asyncio.Event  # the rest is the real module
    time.sleep(0.05)  # everyone else's clock is untouched
    assert asked[-1] == 0.05 and mod.other == 1


def test_the_slow_engine_sleeps_before_every_step_and_gives_the_same_tokens(monkeypatch):
    from arborl.config import EngineConfig
    from arborl.engine import LLMEngine
    from arborl.models import tiny_llama
    from arborl.types import GenerateRequest, SamplingParams

    model = tiny_llama(layers=1, hidden=32, vocab=64, heads=2, kv_heads=1, seed=0)

    def tokens():
        eng = LLMEngine(model, EngineConfig(max_batch_size=2, max_seq_len=64), eos_token_ids=[63])
        return eng.generate([GenerateRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))])[0].token_ids

    plain = tokens()
    slept: list[float] = []
    monkeypatch.setattr(LLMEngine, "step", LLMEngine.step)  # restored after the test
    monkeypatch.setenv("ARBORL_TEST_PACE_STEP_S", "0.001")
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    pace.install_slow_engine()
    assert tokens() == plain and slept == [0.001] * 4  # 5 tokens: the first step prefills and decodes
