"""Engine requests through a dispatch policy over real engines (engine/dispatcher.py): divided
rollout gives the tokens of an undivided request, pieces migrate with their KV, aborts end requests
cleanly, abort-and-resume across a weight update stamps each token with its version, and stop
strings are found across piece boundaries."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from arborl.config import EngineConfig, ModelConfig
from arborl.engine import AsyncEngine, LLMEngine, TokenEvent
from arborl.models import load_model, tiny_llama
from arborl.engine.dispatcher import Dispatcher
from arborl.scheduling.policies import Traced, replay
from arborl.config import SchedulingConfig
from arborl.scheduling.dispatch import PinnedDispatch, SeerDispatch, make_dispatch
from arborl.types import FinishReason, GenerateRequest, SamplingParams

VOCAB = 256


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llama(layers=2, hidden=64, vocab=VOCAB, heads=4, kv_heads=2, seed=5)
    torch.set_num_threads(threads)


def _engines(model, n=2, batch=4, seq=256):
    return [AsyncEngine(LLMEngine(model, EngineConfig(max_batch_size=batch, max_seq_len=seq, engine_id=f"e{i}"),
                                  eos_token_ids=[VOCAB - 1], seed=i)) for i in range(n)]


def _req(i, n=30, temperature=0.0, seed=None, rid=None):
    g = torch.Generator().manual_seed(100 + i)
    prompt = torch.randint(0, VOCAB - 1, (6 + i % 5,), generator=g).tolist()
    return GenerateRequest(prompt, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=seed),
                           request_id=rid or f"r{i}")


def _close(engines):
    for e in engines:
        e.shutdown()


async def first_to_pause(engines, after_tokens: int, timeout: float = 60.0) -> int:
    """Pause whichever engine first generates ``after_tokens`` tokens (the one serving the request);
    the others' pauses are withdrawn. Returns that engine's generated-token count."""
    tries = [asyncio.ensure_future(e.pause(after_tokens=after_tokens)) for e in engines]
    done, pending = await asyncio.wait(tries, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    assert done, "no engine generated the tokens in time"
    return next(iter(done)).result()


def test_divided_rollout_gives_the_undivided_tokens_and_logprobs(model):
    """Greedy requests served in 7-token chunks over two engines (KV transferred on migration) equal
    the same requests served whole by one engine; every request is one result, in order."""
    async def run():
        ref_eng = _engines(model, 1, batch=8)
        engines = _engines(model, 2, batch=3)
        try:
            reqs = [_req(i) for i in range(8)]
            ref = await asyncio.gather(*(ref_eng[0].generate(copy.deepcopy(r)) for r in reqs))
            d = Dispatcher(engines, Traced(SeerDispatch(chunk_tokens=7)), migration="transfer")
            got = await asyncio.gather(*(d.generate(copy.deepcopy(r), f"g{i // 4}") for i, r in enumerate(reqs)))
            return ref, got, d
        finally:
            _close(ref_eng + engines)

    ref, got, d = asyncio.run(run())
    for r, g in zip(ref, got):
        assert g.request_id == r.request_id
        assert g.token_ids == r.token_ids and len(g.token_ids) == 30
        assert max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) < 1e-4
        assert g.finish_reason == FinishReason.LENGTH and g.versions == [0] * 30
    s = d.stats()
    assert s["pieces"] >= 8 * 5  # ceil(30 / 7) = 5 pieces each
    assert s["migrations"] > 0 and s["transferred_tokens"] > 0
    assert s["policy_probes"] >= 2  # the probes' pieces (one probe per group) ran first
    assert not d.live_requests() and d.policy.pending() == 0 and not d.policy.known_requests()  # nothing left behind
    # the gateway path's decisions are the ones the simulator's policy makes on the same events
    fresh = make_dispatch(SchedulingConfig(dispatch="seer", chunk_tokens=7), 2)
    assert replay(d.policy.calls, fresh) == len(d.policy.calls) > 40


def test_recompute_migration_and_sampled_requests_are_reproducible(model):
    """Sampled (seeded) divided requests: the same tokens twice, whatever engine served each piece."""
    async def run():
        engines = _engines(model, 2, batch=2)
        try:
            d = Dispatcher(engines, SeerDispatch(chunk_tokens=5), migration="recompute")
            return await asyncio.gather(*(d.generate(_req(i, temperature=1.0, seed=i), "g") for i in range(5)))
        finally:
            _close(engines)

    a, b = asyncio.run(run()), asyncio.run(run())
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(len(x.token_ids) == 30 for x in a)


def test_stream_yields_every_piece_in_order(model):
    async def run():
        engines = _engines(model, 2, batch=2)
        try:
            d = Dispatcher(engines, SeerDispatch(chunk_tokens=4))
            events, final = [], None
            async for ev in d.stream(_req(1, n=17), "g"):
                if isinstance(ev, TokenEvent):
                    events.append(ev)
                else:
                    final = ev
            return events, final
        finally:
            _close(engines)

    events, final = asyncio.run(run())
    assert [e.index for e in events] == list(range(17))
    assert [e.token_id for e in events] == final.token_ids


def test_abort_queued_and_running_requests(model):
    """An abort ends a queued request at once (no tokens) and a running one with its tokens so far;
    the others finish, and nothing is left in the dispatcher or its policy."""
    async def run():
        engines = _engines(model, 1, batch=1)
        try:
            d = Dispatcher(engines, PinnedDispatch(1))
            running = asyncio.ensure_future(d.generate(_req(0, n=200), "a"))
            queued = asyncio.ensure_future(d.generate(_req(1, n=5), "b"))
            other = asyncio.ensure_future(d.generate(_req(2, n=5), "c"))
            at = await asyncio.wait_for(engines[0].pause(after_tokens=3), 60)  # r0 runs, r1 and r2 queue
            d.abort("r1")
            d.abort("r0")
            ended = await asyncio.wait_for(running, 60)  # a paused engine ends an aborted request at once
            engines[0].resume()
            return ended, at, await queued, await other, d
        finally:
            _close(engines)

    running, at, queued, other, d = asyncio.run(run())
    assert running.finish_reason == FinishReason.ABORT and len(running.token_ids) == at >= 3
    assert queued.finish_reason == FinishReason.ABORT and queued.token_ids == []
    assert other.finish_reason == FinishReason.LENGTH and len(other.token_ids) == 5
    assert not d.live_requests() and d.policy.pending() == 0 and not d.policy.known_requests()


@pytest.mark.parametrize("mode", ["continue", "abort_resume"])
def test_weight_update_mid_request_versions(model, mode):
    """A request in flight across a weight update keeps its earlier tokens at version 0 and carries
    version 1 after it; with abort_resume its piece was aborted before the load and resumed."""
    async def run():
        engines = _engines(model, 2, batch=2)
        try:
            d = Dispatcher(engines, SeerDispatch(chunk_tokens=0))
            fut = asyncio.ensure_future(d.generate(_req(0, n=120), "g"))
            at = await first_to_pause(engines, after_tokens=10)  # the engine serving it, 10 tokens in
            state = {k: v.clone() for k, v in model.state_dict().items()}
            async with d.updating(abort_resume=mode == "abort_resume"):
                await asyncio.gather(*(e.update_weights(state, 1) for e in engines))
            for e in engines:
                e.resume()
            return await fut, at, d
        finally:
            _close(engines)

    res, at, d = asyncio.run(run())
    assert len(res.token_ids) == 120 and res.finish_reason == FinishReason.LENGTH
    assert res.versions == [0] * at + [1] * (120 - at) and at >= 10
    assert d.stats()["resumed"] == (1 if mode == "abort_resume" else 0)


def test_stop_string_found_across_a_piece_boundary():
    """A stop string whose characters straddle two pieces stops the continuation (``continued``
    tells the engine which prompt tokens are the request's own output); without it, it is missed."""
    loaded = load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2", seed=0))
    tok = loaded.tokenizer
    eng = LLMEngine(loaded.model, EngineConfig(max_batch_size=2, max_seq_len=128), eos_token_ids=loaded.eos_token_ids,
                    tokenizer=tok)
    base = tok.encode("hello there")
    full = eng.generate([GenerateRequest(base, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))])[0].token_ids
    k, stop = None, None
    for j in range(2, 20):  # a boundary where last char before + first char after is a new string
        before, after = tok.decode(full[:j]), tok.decode(full[: j + 1])
        if len(after) > len(before) > 0 and after.startswith(before):
            cand = before[-1] + after[len(before)]
            if cand not in before and cand not in after[len(before):]:
                k, stop = j, cand
                break
    assert k is not None, "no usable boundary in the tiny model's output"

    def piece(continued):
        req = GenerateRequest(base + full[:k], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop]),
                              continued=continued)
        return eng.generate([req])[0]

    out = piece(k)
    assert out.finish_reason == FinishReason.STOP and out.token_ids == full[k : k + 1]
    blind = piece(0)  # without ``continued`` the earlier piece's text is not searched: the stop is missed
    assert blind.token_ids[:1] == full[k : k + 1] and len(blind.token_ids) > 1


def test_scripted_tool_episode_through_the_gateway_in_pieces():
    """The real gateway + uvicorn + openai client with a Seer dispatcher serving 4-token pieces over two
    engines: the scripted tool episode comes out token for token (streamed and not), the recorded
    calls are whole and stitched, and /health reports the dispatcher."""
    import json

    import openai

    from helpers.blackbox_gateway import ADD_TOOL, ANSWER, TOOL_CALL_TEXT, script_messages, start_harness

    h = start_harness(num_engines=2, seer_chunk=4)
    try:
        first, _, _ = script_messages()
        for stream in (False, True):
            sid, key = h.new_session(task_id="add", group_id=f"g-{stream}")
            c = openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=0)
            if stream:
                chunks = list(c.chat.completions.create(model=h.model, messages=first, tools=[ADD_TOOL], temperature=0,
                                                        stream=True))
                calls = [tc for ch in chunks for choice in ch.choices for tc in (choice.delta.tool_calls or [])]
                assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
            else:
                r1 = c.chat.completions.create(model=h.model, messages=first, tools=[ADD_TOOL], temperature=0)
                msg = r1.choices[0].message
                tool = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}
                r2 = c.chat.completions.create(model=h.model, messages=first + [msg.model_dump(exclude_none=True), tool],
                                               tools=[ADD_TOOL], temperature=0)
                assert r2.choices[0].message.content == ANSWER
            recorded = h.pool.calls(sid)
            eos = h.loaded.eos_token_ids[0]
            assert recorded[0].completion_token_ids == h.loaded.tokenizer.encode(TOOL_CALL_TEXT) + [eos]
            assert recorded[0].meta["routing"] == "dispatch" and recorded[0].versions == [0] * len(recorded[0].versions)
        health = h.http.get(h.server.url + "/health").json()
        assert health["dispatch"]["pieces"] > health["dispatch"]["requests"] >= 3
    finally:
        h.close()


@pytest.mark.parametrize("policy", ["seer", "pinned"])
def test_an_engine_shutting_down_mid_run_loses_no_request(model, policy):
    """One of two engines shuts down while requests run on it: with Seer the lost pieces continue on
    the other engine from their tokens; pinned groups are re-pinned; every request completes. With no
    engine left, a new request fails at once with EngineClosedError."""
    from arborl.engine import EngineClosedError

    async def run():
        engines = _engines(model, 2, batch=2)
        try:
            pol = SeerDispatch(chunk_tokens=6) if policy == "seer" else PinnedDispatch(2)
            d = Dispatcher(engines, pol, migration="transfer")
            futs = [asyncio.ensure_future(d.generate(_req(i, n=40), f"g{i}")) for i in range(6)]
            await asyncio.wait_for(engines[1].pause(after_tokens=3), 60)  # requests in flight on it
            await asyncio.to_thread(engines[1].shutdown)
            results = await asyncio.gather(*futs, return_exceptions=True)
            engines[0].shutdown()
            with pytest.raises(EngineClosedError):
                await d.generate(_req(9), "g9")
            return results, d
        finally:
            _close(engines)

    results, d = asyncio.run(run())
    if policy == "seer":
        assert all(not isinstance(r, BaseException) and len(r.token_ids) == 40 for r in results), results
        assert d.stats()["rescued"] + d.stats()["migrations"] > 0
    else:  # a request running on the engine that went away fails (retry); the queued ones are re-pinned
        done = [r for r in results if not isinstance(r, BaseException)]
        assert done and all(len(r.token_ids) == 40 for r in done)
        assert all(isinstance(r, EngineClosedError) for r in results if isinstance(r, BaseException))
    assert not d.live_requests() and d.policy.pending() == 0 and not d.policy.known_requests()


def test_transfer_from_a_closed_engine_falls_back_to_recompute(model):
    async def run():
        engines = _engines(model, 2, batch=1)
        ref = _engines(model, 1, batch=1)
        try:
            d = Dispatcher(engines, SeerDispatch(chunk_tokens=5), migration="transfer")
            first = await d.generate(_req(0, n=5), "g")  # its KV now lives on one engine (its home)
            live_home = int(first.engine_id[-1])
            await asyncio.to_thread(engines[live_home].shutdown)
            # a continuation of the same lineage on the survivor: the home is gone, it recomputes
            cont = GenerateRequest(first.prompt_token_ids + first.token_ids,
                                   SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), request_id="c")
            got = await d.generate(cont, "g")
            want = await ref[0].generate(copy.deepcopy(cont))
            return got, want, d
        finally:
            _close(engines + ref)

    got, want, d = asyncio.run(run())
    assert got.token_ids == want.token_ids and d.stats()["transferred_tokens"] == 0


def test_closing_a_stream_early_aborts_the_request(model):
    async def run():
        engines = _engines(model, 1, batch=2)
        try:
            d = Dispatcher(engines, SeerDispatch(chunk_tokens=8))
            n = 0
            agen = d.stream(_req(0, n=200), "g")
            paused = asyncio.ensure_future(engines[0].pause(after_tokens=12))  # inside its second piece
            async for ev in agen:
                n += 1
                if n == 12:
                    break
            await asyncio.wait_for(paused, 60)
            await agen.aclose()
            while d.live_requests() or engines[0].engine.num_running:
                await asyncio.sleep(0.01)
            engines[0].resume()
            return d, engines[0].engine.stats.aborted
        finally:
            _close(engines)

    d, aborted = asyncio.run(run())
    assert aborted == 1 and not d.live_requests() and not d.policy.known_requests() and d.policy.pending() == 0


def test_stop_strings_through_the_dispatcher_match_an_undivided_request():
    """Sampled requests with stop strings, served in 2-token pieces over two engines, stop exactly
    where the same requests served whole stop (same seeds: the first piece's tokens are the same)."""
    loaded = load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2", seed=0))
    tok = loaded.tokenizer

    def engines(n):
        return [AsyncEngine(LLMEngine(loaded.model, EngineConfig(max_batch_size=4, max_seq_len=256, engine_id=f"e{i}"),
                                      eos_token_ids=loaded.eos_token_ids, tokenizer=tok, seed=i)) for i in range(n)]

    async def run():
        ref, eng = engines(1), engines(2)
        try:
            base = tok.encode("Once upon a time")
            greedy = await ref[0].generate(GenerateRequest(base, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))
            text = tok.decode(greedy.token_ids)
            stops = [text[len(text) // 2 : len(text) // 2 + 2]]  # somewhere in the middle, likely across pieces
            req = GenerateRequest(base, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=stops),
                                  request_id="s")
            d = Dispatcher(eng, SeerDispatch(chunk_tokens=2))
            return await ref[0].generate(copy.deepcopy(req)), await d.generate(copy.deepcopy(req), "g")
        finally:
            _close(ref + eng)

    whole, pieces = asyncio.run(run())
    assert whole.finish_reason == FinishReason.STOP and len(whole.token_ids) < 30
    assert pieces.finish_reason == FinishReason.STOP and pieces.token_ids == whole.token_ids


def test_a_piece_running_across_steps_is_in_the_step_it_ends_in(model):
    from arborl.scheduling.timeline import Timeline

    async def run():
        engines = _engines(model, 1, batch=2)
        try:
            d = Dispatcher(engines, SeerDispatch(chunk_tokens=0))
            tl = Timeline()
            d.record(tl, t0=0.0, step=0)
            fut = asyncio.ensure_future(d.generate(_req(0, n=150), "g"))
            await asyncio.wait_for(engines[0].pause(after_tokens=1), 60)
            d.record(tl, t0=0.0, step=1)  # the controller moved on to the next step
            engines[0].resume()
            await fut
            return tl
        finally:
            _close(engines)

    (span,) = asyncio.run(run()).spans
    assert span.step == 1 and span.ended == "finish" and span.tokens == 150


def test_kv_import_into_an_engine_without_a_prefix_cache_moves_nothing(model):
    src = LLMEngine(model, EngineConfig(max_batch_size=1, max_seq_len=64), eos_token_ids=[VOCAB - 1])
    dst = LLMEngine(model, EngineConfig(max_batch_size=1, max_seq_len=64, prefix_cache=False), eos_token_ids=[VOCAB - 1])
    ids = list(range(1, 20))
    src.generate([GenerateRequest(ids, SamplingParams(max_tokens=1, ignore_eos=True))])
    kv, version = src.export_prefix_kv(ids)
    assert kv is not None and kv.shape[3] >= 18
    assert dst.import_prefix_kv(ids, kv, version) == 0
    assert src.import_prefix_kv(ids, kv, version + 1) == 0  # another policy version: refused


def test_a_request_lost_with_its_engine_after_its_first_piece_continues_elsewhere(model):
    """Non-streaming requests already in a later piece when their engine goes away are rescued from the
    tokens their finished pieces made (not failed): every request completes with all its tokens."""

    async def run():
        engines = _engines(model, 2, batch=2)
        try:
            d = Dispatcher(engines, SeerDispatch(chunk_tokens=4), migration="recompute")
            futs = [asyncio.ensure_future(d.generate(_req(i, n=40), f"g{i}")) for i in range(4)]
            # engine 1 stops between two steps once it made 12 tokens (3 pieces' worth): it holds pieces
            await asyncio.wait_for(engines[1].pause(after_tokens=12), 60)
            await asyncio.to_thread(engines[1].shutdown)
            return await asyncio.gather(*futs, return_exceptions=True), d
        finally:
            _close(engines)

    # the shutdown must catch a later piece (not a first one) in flight on engine 1; where the policy
    # placed only first pieces there at that moment, the scenario runs again (every run must complete
    # every request)
    for _ in range(5):
        results, d = asyncio.run(run())
        assert all(not isinstance(r, BaseException) and len(r.token_ids) == 40 for r in results), results
        if d.stats()["rescued"] >= 1:
            break
    assert d.stats()["rescued"] >= 1
