"""The real controller under asynchronous consumption: groups in flight through the gateway, batches
from the consumption policy, staleness bounded, a Gantt PNG per step in the run directory."""

from __future__ import annotations

import json

import pytest

from arborl.config import load_config
from arborl.datapool import DataPool
from arborl.run.job import train
from arborl.scheduling.policies import Traced, window_items


def tiny_cfg(tmp_path, name: str, *extra: str):
    return load_config(None, [
        f"name={name}", f"runs_dir={tmp_path}", "seed=3",
        "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=512", "engine.max_batch_size=16",
        "rollout.task=even_tokens", "rollout.batch_tasks=3", "rollout.group_size=4", "rollout.max_tokens=8",
        "rollout.eval_tasks=0", "rollout.steps=4", "train.lr=0.1", *extra,
    ])


def trace_consumption(monkeypatch) -> list[Traced]:
    """Record every decision of the consumption policy the controller builds (``Traced``)."""
    from arborl.run import controller

    traced: list[Traced] = []
    real = controller.make_consume

    def make_traced(*a, **kw):
        traced.append(Traced(real(*a, **kw)))
        return traced[-1]

    monkeypatch.setattr(controller, "make_consume", make_traced)
    return traced


@pytest.mark.parametrize("consume", ["async_ratio", "windowed_fifo"])
def test_async_consumption_trains_within_the_staleness_bound(tmp_path, monkeypatch, consume):
    """From the policy's recorded decisions and the data pool: async_ratio (α = 1) trains no episode
    with a token more than 1 version older than the trainer version of its step (read from the
    versions the data pool stored); windowed_fifo (W = ceil(0.5 x 3) = 2) consumes no group ahead of
    more than W - 1 older groups still unconsumed (generation order = the order groups started)."""
    traced = trace_consumption(monkeypatch)
    cfg = tiny_cfg(tmp_path, consume, f"scheduling.consume={consume}", "scheduling.async_ratio=1", "scheduling.window=0.5")
    summary = train(cfg)
    steps = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and summary["steps"] == 4
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4]
    assert all(s["samples"] > 0 or s["zero_variance_groups"] > 0 for s in steps)
    for k in range(1, 5):
        assert (cfg.run_dir / "timeline" / f"step{k:04d}.png").stat().st_size > 1000

    (t,) = traced
    started = [args[0] for name, args, _ in t.calls if name == "on_start"]
    batches = [out for name, _, out in t.calls if name == "take_batch" and out is not None]
    assert [b.version for b in batches] == [0, 1, 2, 3]  # step k trains at version k
    assert all(len(b.items) == 3 for b in batches)
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = pool.episodes(with_calls=True)
    by_group: dict[str, list] = {}
    for e in episodes:
        by_group.setdefault(e.group_id, []).append(e)
    assert set(started) <= set(by_group) and all(g.startswith("step") for g in by_group)
    if consume == "async_ratio":
        for b in batches:
            for gid in b.items:
                assert len(by_group[gid]) == cfg.rollout.group_size
                for e in by_group[gid]:
                    oldest = min(v for c in e.calls for v in c.versions)
                    assert b.version - oldest <= 1, (gid, b.version, oldest)
    else:
        # nothing was dropped, cancelled or failed, so an older group not consumed yet was still open
        assert not any(b.dropped or b.cancel for b in batches)
        assert not any(name == "on_fail" or (name == "on_version" and out) for name, _, out in t.calls)
        W = window_items(cfg.scheduling.window, cfg.rollout.batch_tasks)
        consumed: set[str] = set()
        for gid in (g for b in batches for g in b.items):
            older_open = [o for o in started[: started.index(gid)] if o not in consumed]
            assert len(older_open) <= W - 1, (gid, older_open, W)
            consumed.add(gid)


def test_stale_tokens_are_masked(tmp_path):
    cfg = tiny_cfg(tmp_path, "masked", "scheduling.consume=async_ratio", "scheduling.async_ratio=2",
                   "scheduling.stale_token_mask=0", "rollout.steps=3")
    train(cfg)
    steps = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    # with α = 2 some groups started before the last publish: their old tokens get no loss
    assert sum(s["sched/masked_tokens"] for s in steps if s["kind"] == "step") > 0


def test_real_controller_decisions_replay_into_the_simulators_policy(tmp_path, monkeypatch):
    """The asyncio controller's consumption decisions, recorded during real training, are the decisions
    the simulator's policy (built by ``arborl.sim.build_policies``) makes on the same event sequence."""
    from arborl.scheduling.policies import replay
    from arborl.sim import build_policies

    traced = trace_consumption(monkeypatch)
    cfg = tiny_cfg(tmp_path, "replay", "scheduling.consume=async_ratio", "scheduling.async_ratio=1", "rollout.steps=3")
    train(cfg)
    (t,) = traced
    kinds = {name for name, _, _ in t.calls}
    assert {"can_start", "on_start", "on_finish", "take_batch", "on_version"} <= kinds
    fresh, _ = build_policies(cfg.scheduling, "async_ratio", "pinned", batch_size=cfg.rollout.batch_tasks, instances=1)
    assert replay(t.calls, fresh) == len(t.calls)


def _steps(cfg):
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [s for s in rows if s["kind"] == "step"]


def test_seer_dispatch_in_training_divides_requests_over_engines(tmp_path):
    """`arborl train` with scheduling.dispatch=seer: every engine request goes through the dispatcher in
    2-token pieces over two engines; the recorded calls are whole (merged). Whether a piece changes
    engine depends on which engine frees a slot first, i.e. on timing: migration itself is checked on
    the dispatcher alone (test_dispatcher.py), not here."""
    cfg = tiny_cfg(tmp_path, "seer", "scheduling.dispatch=seer", "scheduling.chunk_tokens=2", "gateway.num_engines=2",
                   "rollout.steps=2", "rollout.max_tokens=16")
    summary = train(cfg)
    assert summary["steps"] == 2
    steps = _steps(cfg)
    last = steps[-1]
    assert last["dispatch/requests"] >= 2 * 3 * 4
    assert last["dispatch/pieces"] > last["dispatch/requests"]  # 16-token requests in 2-token pieces
    assert last["dispatch/policy_probes"] > 0
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        calls = [c for e in pool.episodes() for c in pool.get_episode(e.episode_id).calls]
    assert calls and all(len(c.completion_token_ids) <= 16 for c in calls)
    assert any(len(c.completion_token_ids) > 2 for c in calls)  # merged across pieces
    # whether some call was served by both engines depends on which engine frees a slot first (the docstring):
    # not asserted here; it failed once under a loaded machine (2026-12-07)
    # the timeline has a span per piece: chunks and finishes, on both engines, probes marked
    spans = [json.loads(x) for x in (cfg.run_dir / "timeline" / "spans.jsonl").read_text().splitlines()]
    spans = [x for x in spans if x["kind"] == "span"]
    assert {x["ended"] for x in spans} >= {"chunk", "finish"} and {x["instance"] for x in spans} == {0, 1}
    assert any(x["probe"] for x in spans) and {x["step"] for x in spans} == {0, 1}
    assert len(spans) == last["dispatch/pieces"]
    assert (cfg.run_dir / "timeline" / "step0002.png").stat().st_size > 1000


def test_abort_resume_and_oversampling_in_training(tmp_path):
    """Async consumption with partial_rollout=abort_resume (the engines get a dispatcher), and
    synchronous over-sampling (surplus groups cancelled or dropped): both train; every token's version
    is one the trainer published, and a call's versions never go down. (Whether a request is in
    flight at a publish here is timing: the next test forces one through the engine pool.)"""
    cfg = tiny_cfg(tmp_path, "resume", "scheduling.consume=async_ratio", "scheduling.partial_rollout=abort_resume",
                   "gateway.num_engines=2", "rollout.steps=3", "rollout.max_tokens=24")
    assert train(cfg)["steps"] == 3
    steps = _steps(cfg)
    assert steps[-1]["dispatch/pieces"] >= steps[-1]["dispatch/requests"] >= 3 * 3 * 4
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        calls = [c for e in pool.episodes() for c in pool.get_episode(e.episode_id).calls]
    assert all(c.versions == sorted(c.versions) and set(c.versions) <= {0, 1, 2, 3} for c in calls)

    cfg = tiny_cfg(tmp_path, "oversample", "scheduling.oversample=0.5", "rollout.steps=2")
    assert train(cfg)["steps"] == 2
    steps = _steps(cfg)
    assert sum(s["sched/cancelled_groups"] for s in steps) + sum(s["sched/dropped_groups"] for s in steps) > 0


def test_abort_resume_at_a_publish_resumes_requests_in_flight_under_the_new_weights():
    """The engine pool the controller publishes through, configured with partial_rollout=abort_resume:
    requests surely in flight at a weight update (64 tokens, EOS ignored, the update sent once every
    request has its first token) are aborted and resumed from their tokens. Each result reads
    [0] * k + [1] * (n - k) with 0 < k < n; its first k tokens carry the old policy's log-probs and the
    rest the new policy's (teacher-forced on prompt + tokens); the pool counts one resumption each."""
    import asyncio
    import copy

    import torch

    from arborl.config import EngineConfig, SchedulingConfig
    from arborl.engine import AsyncEngine, LLMEngine
    from arborl.engine.pool import EnginePool
    from arborl.models import tiny_llama
    from arborl.types import GenerateRequest, SamplingParams

    vocab, n = 256, 64
    old, new = (tiny_llama(layers=1, hidden=32, vocab=vocab, heads=2, kv_heads=1, seed=s) for s in (0, 1))
    prompts = [list(range(1 + i, 9 + i)) for i in range(4)]

    async def run():
        engines = [AsyncEngine(LLMEngine(copy.deepcopy(old), EngineConfig(max_batch_size=4, max_seq_len=256, engine_id=f"e{i}"),
                                         eos_token_ids=[vocab - 1])) for i in range(2)]
        try:
            pool = EnginePool.from_config(engines, SchedulingConfig(partial_rollout="abort_resume"))
            streams = []
            for i, p in enumerate(prompts):
                lease = pool.lease(session_id=f"s{i}", group_id=f"g{i // 2}", current=None, n=1)
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                streams.append(lease.engine.stream(GenerateRequest(p, params, request_id=f"r{i}")))
            firsts = [await s.__anext__() for s in streams]  # every request is running
            await pool.update_weights({k: v.clone() for k, v in new.state_dict().items()}, 1)
            results = []
            for s in streams:
                async for ev in s:
                    last = ev
                results.append(last)
            return firsts, results, pool.dispatch_stats()
        finally:
            for e in engines:
                e.shutdown()

    firsts, results, stats = asyncio.run(run())
    assert all(f.version == 0 for f in firsts)
    assert stats["resumed"] == len(prompts)

    @torch.no_grad()
    def logprobs(model, prompt, tokens):
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
        return logp[torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1), torch.tensor(tokens)]

    for p, res in zip(prompts, results):
        assert len(res.token_ids) == n and 1 in res.versions
        k = res.versions.index(1)
        assert 0 < k < n and res.versions == [0] * k + [1] * (n - k), res.versions
        got = torch.tensor(res.logprobs)
        assert torch.allclose(got[:k], logprobs(old, p, res.token_ids)[:k], atol=1e-4)
        assert torch.allclose(got[k:], logprobs(new, p, res.token_ids)[k:], atol=1e-4)


def test_tool_use_counts_episodes_with_a_recorded_tool_run_whatever_the_suite():
    from arborl.run.controller import tool_use
    from arborl.types import Episode

    tool = Episode("t1", interactions=[{"kind": "tool", "tool": "run", "after_call": "c1"}])
    other = Episode("t2", interactions=[{"kind": "penalty"}])
    none = Episode("t3")
    assert tool_use([tool, other, none, tool]) == 0.5
    assert tool_use([]) == 0.0
