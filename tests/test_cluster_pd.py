"""Prefill/decode disaggregation in process (cluster.pd_prefill_engines): the prompt's KV is computed on
the prefill engine and moved to the decode engine, and greedy outputs equal colocated ones token for
token, over multi-turn prompts; too many prefill engines is a clear config error."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.tiny_run import tiny_cfg  # noqa: E402

from arborl.run.assemble import build_gateway  # noqa: E402
from arborl.cluster import PDEngine  # noqa: E402
from arborl.config import ConfigError  # noqa: E402
from arborl.types import GenerateRequest, SamplingParams  # noqa: E402


def _greedy(prompt, rid, n=16):
    return GenerateRequest(list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), request_id=rid)


async def _turns(engine, tag):
    """Three turns, each prompt extending the last one with the answer and a new observation."""
    prompt, outs = list(range(3, 70)), []
    for t in range(3):
        if t % 2:
            res = await engine.generate(_greedy(prompt, f"{tag}{t}"))
        else:
            res = None
            async for ev in engine.stream(_greedy(prompt, f"{tag}{t}")):
                res = ev
        outs.append(res)
        prompt = prompt + res.token_ids + list(range(200 + 10 * t, 230 + 10 * t))
    return outs


def test_pd_outputs_equal_colocated_token_for_token(tmp_path):
    pd = build_gateway(tiny_cfg(tmp_path, "pd", "gateway.num_engines=2", "cluster.pd_prefill_engines=1"), run_dir=tmp_path / "pd")
    co = build_gateway(tiny_cfg(tmp_path, "co"), run_dir=tmp_path / "co")
    try:
        (handle,) = pd.engines.engines  # one decode engine fed by one prefill engine
        assert isinstance(handle, PDEngine) and handle.engine_id == "engine-1"
        assert handle.prefiller.engine.engine_id == "engine-0"
        got = asyncio.run(_turns(handle, "pd"))
        want = asyncio.run(_turns(co.engines.engines[0], "co"))
        stats = asyncio.run(handle.stats())
    finally:
        pd.close()
        co.close()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(len(r.token_ids) == 16 for r in got)
    # the decode engine prefilled only each prompt's last token; the colocated one ran whole turns' tokens
    assert all(r.cached_prompt_tokens == len(r.prompt_token_ids) - 1 for r in got)
    assert stats["pd_prefills"] == 3 and stats["pd_fallbacks"] == 0
    assert stats["pd_moved_tokens"] == sum(len(r.prompt_token_ids) for r in got)


def test_pd_without_a_decode_engine_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="pd_prefill_engines"):
        build_gateway(tiny_cfg(tmp_path, "x", "gateway.num_engines=2", "cluster.pd_prefill_engines=2"), run_dir=tmp_path / "x")
