"""engine.backend=vllm against a real vLLM server (the CPU build from `make vllm`), started once for the
module on a tiny random Llama with SmolLM2's tokenizer and tied embeddings: token ids in and out equal to the built-in
engine's and to the data pool's records, seeds, stop strings, abort, a weight update (outputs and
versions change; a request in flight carries both versions), a stitched multi-turn episode through the
gateway is one sample, a Seer piece continuation equals the undivided request, and a killed server
is a retryable failure that the supervisor restarts (serving the newest weights)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal

import httpx
import pytest
import torch

from arborl.run.assemble import build_gateway
from arborl.config import load_config
from arborl.engine.backends import ENGINE_BACKENDS
from arborl.engine.backends.remote import Piece
from arborl.engine.backends.vllm import VLLMEngine, vllm_python
from arborl.gateway.errors import EngineFailedError
from arborl.models import load_model, tiny_llama
from arborl.scheduling.partial import continuation, merge
from arborl.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

OVERRIDES = ["model.source=tiny", "model.tiny_hidden=128", "model.tiny_tokenizer=smollm2", "engine.backend=vllm",
             "engine.max_seq_len=512", "engine.max_batch_size=8", "engine.vllm.kv_cache_gib=1",
             "engine.vllm.max_restarts=1"]


def _vllm_installed() -> bool:
    try:
        vllm_python("auto")
        return True
    except Exception:  # noqa: BLE001
        return False


if not _vllm_installed():
    pytest.skip("vLLM's CPU build is not installed in .venv-vllm: run `make vllm` (make test does)", allow_module_level=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cfg = load_config(None, OVERRIDES)
    base = load_model(cfg.model)
    # tied input/output embeddings, as SmolLM2's: a weight update must reach the head too
    loaded = dataclasses.replace(base, model=tiny_llama(hidden=128, vocab=base.vocab_size, tie_embeddings=True))
    built = build_gateway(cfg, loaded=loaded, run_dir=tmp_path_factory.mktemp("run"))
    ref = ENGINE_BACKENDS.get("builtin")(cfg, loaded)  # the built-in engine on the same weights
    yield built, built.engines.engines[0], ref, loaded
    ref.shutdown()
    built.close()


def run(coro):
    return asyncio.run(coro)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


PROMPT = list(range(300, 340))


def hold_after(monkeypatch, eng, request_id: str, n: int) -> asyncio.Event:
    """The engine reads the first ``n`` tokens of ``request_id``'s first segment from the real server, then waits
    for more, as over a slow network, until the segment is cancelled (an update, an abort). The returned event is
    set once it waits: from then on the request is in flight for the engine, whatever the server's speed (a
    fast server may have finished it already; what it sent after the ``n`` tokens is never read)."""
    waiting, serve = asyncio.Event(), eng.stream_segment

    async def stream_segment(client, seg):
        got = 0
        async with contextlib.aclosing(serve(client, seg)) as pieces:
            async for piece in pieces:
                if seg.request_id != request_id:
                    yield piece
                    continue
                take = piece.token_ids[: n - got]
                got += len(take)
                yield Piece(take, piece.logprobs[: len(take)], None, piece.cached_tokens)
                if got == n:
                    waiting.set()
                    await asyncio.Event().wait()  # until cancelled

    monkeypatch.setattr(eng, "stream_segment", stream_segment)
    return waiting


def test_token_round_trip_equals_builtin_engine_and_the_records(env):
    built, eng, ref, _ = env
    assert isinstance(eng, VLLMEngine)
    v0 = eng.version

    async def go():
        gw = built.gateway
        info = await gw.create_session(task_id="t", group_id="g")
        resp = await gw.chat_completion(info.session, {"messages": [{"role": "user", "content": "What is 2+3?"}],
                                                       "temperature": 0, "max_tokens": 16, "return_token_ids": True})
        traj = await gw.trajectory(info.session)
        mine = await ref.generate(GenerateRequest(list(traj["calls"][0]["prompt_token_ids"]), greedy(16)))
        return resp, traj, mine

    resp, traj, mine = run(go())
    [call] = traj["calls"]
    seen = resp["choices"][0]["token_ids"]
    assert seen == call["completion_token_ids"] == mine.token_ids  # client == record == our engine
    assert call["versions"] == [v0] * len(seen) and call["engine_id"] == eng.engine_id
    assert call["logprobs"] == pytest.approx(mine.logprobs, abs=2e-3)
    assert call["sample_logprobs"] == [0.0] * len(seen)  # greedy, as the built-in engine records


def test_seeded_sampling_repeats_and_stop_strings_match_the_builtin_engine(env):
    _, eng, ref, loaded = env

    async def go():
        a = await eng.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0.8, max_tokens=12, seed=7)))
        b = await eng.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0.8, max_tokens=12, seed=7)))
        full = await eng.generate(GenerateRequest(PROMPT, greedy(24, ignore_eos=True)))
        text = loaded.tokenizer.decode(full.token_ids[6:9], skip_special_tokens=False)
        stop = text.strip()[:3] or text[:3]
        ours = await eng.generate(GenerateRequest(PROMPT, greedy(24, ignore_eos=True, stop=[stop])))
        theirs = await ref.generate(GenerateRequest(PROMPT, greedy(24, ignore_eos=True, stop=[stop])))
        return a, b, full, ours, theirs, stop

    a, b, full, ours, theirs, stop = run(go())
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert all(lp < 0 for lp in a.sample_logprobs)  # vLLM's processed log-probs: the sampling distribution
    assert ours.finish_reason.value == "stop" and len(ours.token_ids) < 24
    assert ours.token_ids == theirs.token_ids == full.token_ids[: len(ours.token_ids)]
    assert stop in loaded.tokenizer.decode(ours.token_ids, skip_special_tokens=False)


def test_abort_ends_the_request_with_its_tokens(env, monkeypatch):
    _, eng, _, _ = env
    req = GenerateRequest(PROMPT, greedy(400, ignore_eos=True))
    fifth = hold_after(monkeypatch, eng, req.request_id, 5)

    async def consume(seen: list[int]):
        async for ev in eng.stream(req):
            if hasattr(ev, "token_id"):
                seen.append(ev.token_id)
            else:
                return ev

    async def go():
        seen: list[int] = []
        task = asyncio.ensure_future(consume(seen))
        await fifth.wait()  # the request holds its fifth token and waits for more
        eng.abort(req.request_id)
        result = await task
        return len(seen), result  # every token the stream sent, counted after its result

    n, result = run(go())
    assert result.finish_reason.value == "abort"
    assert len(result.token_ids) == n == 5
    assert eng.load() == 0


def test_a_piece_continuation_equals_the_undivided_request(env):
    _, eng, _, _ = env
    params = greedy(30, ignore_eos=True)

    async def go():
        whole = await eng.generate(GenerateRequest(PROMPT, params))
        first = await eng.generate(GenerateRequest(PROMPT, greedy(11, ignore_eos=True), request_id="p#0"))
        piece = continuation(PROMPT, [first], params, request_id="p#1", chunk_tokens=0)
        second = await eng.generate(piece)
        return whole, merge(PROMPT, [first, second])

    whole, merged = run(go())
    assert merged.token_ids == whole.token_ids and len(whole.token_ids) == 30
    assert merged.logprobs == pytest.approx(whole.logprobs, abs=2e-3)


def test_stitched_multi_turn_episode_on_vllm_is_one_sample(env):
    built, _, _, _ = env

    async def go():
        gw = built.gateway
        info = await gw.create_session(task_id="mt", group_id="g2")
        msgs = [{"role": "user", "content": "Say hi."}]
        r1 = await gw.chat_completion(info.session, {"messages": msgs, "temperature": 0, "max_tokens": 8})
        msgs += [r1["choices"][0]["message"], {"role": "user", "content": "Again."}]
        await gw.chat_completion(info.session, {"messages": msgs, "temperature": 0, "max_tokens": 8})
        return await gw.trajectory(info.session)

    traj = run(go())
    c1, c2 = traj["calls"]
    assert c2["prompt_token_ids"][: len(c1["prompt_token_ids"]) + len(c1["completion_token_ids"])] == \
        c1["prompt_token_ids"] + c1["completion_token_ids"]  # stitched on the exact ids vLLM returned
    [sample] = traj["samples"]
    assert sample["token_ids"] == c2["prompt_token_ids"] + c2["completion_token_ids"]
    assert sum(sample["loss_mask"]) == len(c1["completion_token_ids"]) + len(c2["completion_token_ids"])


def test_weight_update_changes_outputs_and_versions_in_flight(env, monkeypatch):
    _, eng, ref, loaded = env
    req = GenerateRequest(PROMPT, greedy(300, ignore_eos=True))
    third = hold_after(monkeypatch, eng, req.request_id, 3)
    base = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as the trainer's state of a tied model is
    v0 = eng.version

    async def go():
        before = await eng.generate(GenerateRequest(PROMPT, greedy(16, ignore_eos=True)))
        task = asyncio.ensure_future(eng.generate(req))
        await third.wait()  # in flight: 3 tokens under v0 read, the rest still to come
        seconds = await eng.update_weights(new, v0 + 1)
        in_flight = await task
        after = await eng.generate(GenerateRequest(PROMPT, greedy(16, ignore_eos=True)))
        await ref.update_weights(new, v0 + 1)
        mine = await ref.generate(GenerateRequest(PROMPT, greedy(16, ignore_eos=True)))
        return before, in_flight, after, mine, seconds

    before, in_flight, after, mine, seconds = run(go())
    assert after.token_ids != before.token_ids and after.versions == [v0 + 1] * 16
    assert after.token_ids == mine.token_ids  # vLLM serves exactly the new weights
    assert after.logprobs == pytest.approx(mine.logprobs, abs=2e-3)
    # the update stopped the segment after its 3 tokens; the engine asked the rest of the new weights
    assert in_flight.versions == [v0] * 3 + [v0 + 1] * 297 and len(in_flight.token_ids) == 300
    assert 0 < seconds < 60


async def _vllm_running(http: httpx.AsyncClient, url: str) -> float:
    """vLLM's gauge of requests running (its Prometheus /metrics)."""
    text = (await http.get(f"{url}/metrics", timeout=60)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


def test_killed_server_is_a_retryable_failure_and_comes_back(env):
    built, eng, ref, _ = env
    pid = eng.server.pid

    async def go():
        gw = built.gateway
        info = await gw.create_session(task_id="k", group_id="g3")
        body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient() as http:
            for _ in range(5):  # until the server holds the request mid-way (a fast server may finish it first)
                task = asyncio.ensure_future(gw.chat_completion(info.session, body))
                while not any(len(live.tokens) >= 2 for live in list(eng._live.values())) and not task.done():
                    await asyncio.sleep(0.01)
                # vLLM stops stepping and keeps its requests (/pause?mode=keep): one still running now stays
                # in flight until the kill, whatever the machine's speed
                assert (await http.post(f"{eng.url}/pause", params={"mode": "keep"}, timeout=60)).status_code == 200
                if await _vllm_running(http, eng.url) > 0:
                    break
                await http.post(f"{eng.url}/resume", timeout=60)
                await task
            else:
                raise AssertionError("the server finished every request before it could be paused")
        os.killpg(pid, signal.SIGKILL)
        with pytest.raises(EngineFailedError, match="retry"):
            await task
        await asyncio.to_thread(eng.server.wait_ready)  # the supervisor restarts it
        back = await eng.generate(GenerateRequest(PROMPT, greedy(16, ignore_eos=True)))
        mine = await ref.generate(GenerateRequest(PROMPT, greedy(16, ignore_eos=True)))
        again = await gw.chat_completion(info.session, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        return back, mine, again

    back, mine, again = run(go())
    assert eng.server.restarts == 1 and eng.server.pid != pid
    assert back.token_ids == mine.token_ids and back.versions == [eng.version] * 16  # it serves the newest weights
    assert again["choices"][0]["finish_reason"] in ("stop", "length")
