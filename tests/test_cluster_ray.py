"""cluster.backend=ray on a local Ray cluster (ray.init(num_cpus=2), one per module): two engine actors
behind the gateway serve a training step and load its weights; PD over two actors equals colocated
greedy decoding; an engine actor killed mid-rollout loses no request and comes back at the current
version; a placement group the cluster cannot hold fails fast with a clear error."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray cluster and two engine processes: ~40 s of setup on a quiet 2-core machine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.tiny_run import tiny_cfg  # noqa: E402

from arborl.run.assemble import build_gateway  # noqa: E402
from arborl.cluster import ClusterError, disaggregate  # noqa: E402
from arborl.cluster.remote import ActorEngine  # noqa: E402
from arborl.config import SchedulingConfig  # noqa: E402
from arborl.run.controller import Controller  # noqa: E402
from arborl.engine.pool import EnginePool  # noqa: E402
from arborl.models import load_model  # noqa: E402
from arborl.tasks import make_suite  # noqa: E402
from arborl.train.trainer import Trainer  # noqa: E402
from arborl.types import GenerateRequest, SamplingParams  # noqa: E402



@pytest.fixture(scope="module")
def deployed(ray_session, tmp_path_factory):
    """The tiny job with two engine actors, a trainer in the driver, and the controller over them."""
    runs = tmp_path_factory.mktemp("runs")
    cfg = tiny_cfg(runs, "ray", "cluster.backend=ray", "gateway.num_engines=2", "cluster.engine_cpus=1",
                   "cluster.placement_strategy=SPREAD")
    loaded = load_model(cfg.model)
    trainer = Trainer(loaded.model, cfg.train, temperature=cfg.rollout.temperature)
    built = build_gateway(cfg, loaded=dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).eval()),
                          run_dir=runs / "ray")
    try:
        yield cfg, built, trainer
    finally:
        built.close()
    assert ray.is_initialized()  # the module's own session is the caller's: the deployment left it open


def _greedy(prompt, n=12, rid=None):
    return GenerateRequest(list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           **({"request_id": rid} if rid else {}))


def test_two_engine_actors_serve_a_training_step(deployed):
    cfg, built, trainer = deployed
    engines = built.engines.engines
    assert [type(e) for e in engines] == [ActorEngine, ActorEngine]
    assert len({e.pid for e in engines} | {os.getpid()}) == 3  # each engine in its own process
    pg = ray.util.placement_group_table(built.cluster.pg)
    assert pg["strategy"] == "SPREAD" and list(pg["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]

    async def step():
        ctl = Controller(cfg, built.gateway, built.engines, built.pool, trainer, make_suite(cfg.rollout))
        try:
            return await ctl.train_step(0)
        finally:
            await ctl.close()

    m = asyncio.run(step())
    assert m["samples"] > 0
    episodes = built.pool.episodes()
    served_by = {c.engine_id for e in episodes for c in e.calls}
    assert served_by == {"engine-0", "engine-1"}  # the gateway placed calls on both actors
    assert [e.version for e in engines] == [1, 1]

    async def after():  # the actors serve the trained weights: same greedy tokens as the trainer's model
        return [await e.generate(_greedy([5, 6, 7, 8])) for e in engines]

    results = asyncio.run(after())
    assert all(r.versions == [1] * 12 for r in results)
    model = copy.deepcopy(trainer.model).eval()
    model.load_state_dict(trainer.engine_state())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert results[0].token_ids == results[1].token_ids == ids[0, 4:].tolist()


def test_pd_over_two_actors_equals_colocated(deployed):
    _, built, _ = deployed
    engines = built.engines.engines
    pd = disaggregate(engines, 1)[0]  # engine-0 prefills, engine-1 decodes

    async def run():
        turn1 = list(range(3, 60))
        a = await pd.generate(_greedy(turn1, rid="pd-1"))
        turn2 = turn1 + a.token_ids + list(range(100, 140))  # the next turn extends the conversation
        b = await pd.generate(_greedy(turn2, rid="pd-2"))
        c = [await engines[0].generate(_greedy(p, rid=f"co-{i}")) for i, p in enumerate((turn1, turn2))]
        return a, b, c

    a, b, (ca, cb) = asyncio.run(run())
    assert a.token_ids == ca.token_ids and b.token_ids == cb.token_ids
    assert a.engine_id == b.engine_id == "engine-1"
    assert b.cached_prompt_tokens >= len(b.prompt_token_ids) - 1  # decode engine prefilled only the last token
    assert pd.prefiller.counts["prefills"] == 2 and pd.prefiller.counts["moved_tokens"] > 0


def test_killed_engine_actor_loses_no_request_and_rejoins_at_the_current_version(deployed):
    _, built, trainer = deployed
    engines = built.engines.engines
    # one piece per request (chunk_tokens >= its tokens): a piece lost with its engine continues elsewhere
    pool = EnginePool.from_config(engines, SchedulingConfig(dispatch="seer", chunk_tokens=256, migration="recompute"))
    built.cluster.attach(pool)  # as build_gateway does: a rejoined engine gets pieces again
    victim = engines[0]
    old_pid = victim.pid

    async def run():
        reqs = [_greedy([10 + i, 20, 30], n=200, rid=f"f{i}") for i in range(6)]
        tasks = [asyncio.ensure_future(pool.lease(session_id=f"s{i}", group_id=f"g{i % 2}", current=None, n=1)
                                       .engine.generate(r)) for i, r in enumerate(reqs)]
        while pool.dispatcher.counts["pieces"] < 6:
            await asyncio.sleep(0.01)
        # the victim stops between two steps with its pieces in flight: the kill loses them, whatever the speed
        await asyncio.wait_for(victim.pause(after_tokens=10), 120)
        os.kill(old_pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        # new weights while the actor is down: it must load them when it comes back
        state = {k: v + 0.01 * torch.randn_like(v) for k, v in trainer.engine_state().items()}
        await built.engines.update_weights(state, 2)
        deadline = time.monotonic() + 120
        while victim.down and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        info = await victim.actor.info.remote()
        back = await victim.generate(_greedy([1, 2, 3]))
        other = await engines[1].generate(_greedy([1, 2, 3]))
        # Seer dispatch places pieces on the restarted engine again (least loaded engine asks first)
        again = await asyncio.gather(*(pool.lease(session_id=f"r{i}", group_id=f"r{i}", current=None, n=1)
                                       .engine.generate(_greedy([40 + i, 41], n=4, rid=f"r{i}")) for i in range(4)))
        return results, info, back, other, again

    results, info, back, other, again = asyncio.run(run())
    assert {r.engine_id for r in again} == {"engine-0", "engine-1"}
    assert all(r.versions == [2] * 4 for r in again)
    assert all(len(r.token_ids) == 200 and r.finish_reason.value == "length" for r in results)  # none lost
    assert pool.dispatcher.counts["rescued"] >= 1
    assert not victim.down and victim.restarts == 1 and victim.pid != old_pid and info["pid"] == victim.pid
    assert info["version"] == victim.version == 2
    assert back.versions == [2] * 12 and back.token_ids == other.token_ids  # the same weights as the others
    assert 0 not in built.engines.router.down  # routed to again


def test_a_placement_group_the_cluster_cannot_hold_fails_fast(ray_session, tmp_path):
    cfg = tiny_cfg(tmp_path, "big", "cluster.backend=ray", "gateway.num_engines=2", "cluster.engine_cpus=1.5",
                   "cluster.placement_timeout_s=3")
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="engine_cpus"):
        build_gateway(cfg, run_dir=tmp_path / "big")
    assert time.monotonic() - t0 < 30
    assert ray.is_initialized()


def test_rollout_workers_reserve_cluster_worker_cpus_and_fail_fast_when_they_do_not_fit(deployed, tmp_path):
    from arborl.cluster.workers import RayWorkerPool

    cfg = tiny_cfg(tmp_path, "w", "cluster.worker_cpus=0.75", "cluster.placement_timeout_s=3")
    pool = RayWorkerPool(1, cfg.rollout, cfg.cluster, base_url="http://127.0.0.1:9/v1", model="m")
    with pytest.raises(ClusterError, match="worker_cpus=0.75"):  # the two engines hold both CPUs
        asyncio.run(pool.start())
    assert pool.pg is None  # its placement group was removed again


def test_a_training_step_survives_an_engine_actor_killed_mid_rollout_and_loses_nothing(deployed):
    cfg, built, trainer = deployed
    victim = built.engines.engines[1]
    old_pid = victim.pid

    async def step():
        ctl = Controller(cfg, built.gateway, built.engines, built.pool, trainer, make_suite(cfg.rollout))
        try:
            task = asyncio.ensure_future(ctl.train_step(5))
            start = built.gateway.stats.requests
            while built.gateway.stats.requests < start + 4 and not task.done():  # the rollout is under way
                await asyncio.sleep(0.005)
            os.kill(old_pid, signal.SIGKILL)
            return await task
        finally:
            await ctl.close()

    m = asyncio.run(step())
    assert m["samples"] > 0  # the step finished and trained
    episodes = built.pool.episodes()
    assert not [e for e in episodes if e.status.value == "running"]  # every episode ended, none left dangling
    assert sum(len(e.calls) for e in episodes) == built.gateway.stats.calls_recorded  # every 200 is in the pool
    failed = [e for e in episodes if e.meta.get("infra_error")]
    assert all(e.status.value == "failed" for e in failed)  # calls lost with the actor: retried, never trained
    assert victim.down or victim.pid != old_pid  # it died (coming back is the previous test's check)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _reference_greedy(trainer, state, prompt, n=12):
    model = copy.deepcopy(trainer.model).eval()
    model.load_state_dict(state)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()


def test_collective_weight_sync_broadcasts_and_survives_a_killed_member(deployed):
    """cluster.weight_sync=collective (gloo here): versions reach both actors exactly by broadcast, one
    group for all of them; a member killed before a broadcast sends that version through the object
    store, the restarted actor loads it, and the next version re-forms the group with it."""
    from arborl.cluster.collective import CollectiveSync

    _, built, trainer = deployed
    engines = built.engines.engines
    sync = CollectiveSync()
    built.cluster.use_sync(sync)
    sync.timeout_s = 30
    assert sync.backend == "gloo"
    victim = engines[0]

    def state(v):
        return {k: t + 0.01 * v * torch.randn_like(t) for k, t in trainer.engine_state().items()}

    async def run():
        deadline = time.monotonic() + 120
        while any(e.down for e in engines) and time.monotonic() < deadline:  # an earlier test's kill
            await asyncio.sleep(0.2)
        s = {v: state(v) for v in (20, 21, 22, 23)}
        await built.engines.update_weights(s[20], 20)
        await built.engines.update_weights(s[21], 21)
        first = [await e.generate(_greedy([5, 6, 7])) for e in engines]
        groups = sync.groups_formed
        os.kill(victim.pid, signal.SIGKILL)
        while _alive(victim.pid):  # dead before the broadcast, however fast Ray restarts it
            await asyncio.sleep(0.01)
        await built.engines.update_weights(s[22], 22)  # the broadcast meets a dead member
        while victim.down and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        at_rejoin = victim.version
        await built.engines.update_weights(s[23], 23)
        last = [await e.generate(_greedy([5, 6, 7])) for e in engines]
        # a version asked of an actor that did not receive its broadcast (as one rejoining just after it):
        # the handle falls back to the object-store copy
        again = await victim.update_weights(s[23], 23)
        return s, first, groups, at_rejoin, last, again

    s, first, groups, at_rejoin, last, again = asyncio.run(run())
    assert again > 0 and victim.version == 23 and not victim.down

    assert groups == 1  # two versions, one group
    assert [r.token_ids for r in first] == [_reference_greedy(trainer, s[21], [5, 6, 7])] * 2
    assert sync.fallbacks == 1 and at_rejoin == 22  # the version it missed, through the object store
    assert sync.groups_formed == 2  # re-formed with the restarted actor
    assert all(r.versions == [23] * 12 for r in last)
    assert [r.token_ids for r in last] == [_reference_greedy(trainer, s[23], [5, 6, 7])] * 2


def test_rollout_worker_actor_killed_mid_step_fails_only_its_episodes_which_are_retried(deployed):
    """rollout.workers=2 on Ray: the episodes run in two worker actors; one is SIGKILLed mid-rollout:
    its episodes are infrastructure failures (retried, never trained on), no other episode or call is
    lost, the step trains, and Ray restarts the worker."""
    from arborl.cluster.workers import RayWorkerPool

    cfg, built, trainer = deployed
    wcfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"workers": 2, "infra_retries": 3}),
                                  "cluster": cfg.cluster.model_copy(update={"worker_cpus": 0.0})})
    before = {e.episode_id for e in built.pool.episodes()}

    async def step():
        deadline = time.monotonic() + 120
        while any(e.down for e in built.engines.engines) and time.monotonic() < deadline:  # an earlier test's kill
            await asyncio.sleep(0.2)
        ctl = Controller(wcfg, built.gateway, built.engines, built.pool, trainer, make_suite(wcfg.rollout))
        try:
            task = asyncio.ensure_future(ctl.train_step(7))
            while (ctl.workers is None or ctl.workers.stats()["in_flight"] < 4) and not task.done():
                await asyncio.sleep(0.005)
            pool = ctl.workers
            assert isinstance(pool, RayWorkerPool) and len(set(pool.pids()) | {os.getpid()}) == 3
            victim = pool.pids()[0]
            os.kill(victim, signal.SIGKILL)
            m = await task
            while pool.stats()["worker_restarts"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return m, pool.stats(), victim, pool.pids()
        finally:
            await ctl.close()

    m, stats, victim, pids = asyncio.run(step())
    assert m["samples"] > 0
    assert stats["worker_deaths"] == 1 and stats["worker_restarts"] == 1 and victim not in pids and len(pids) == 2
    episodes = [e for e in built.pool.episodes() if e.episode_id not in before]
    failed = [e for e in episodes if e.meta.get("infra_error")]
    assert failed and all(e.status.value == "failed" and "rollout worker" in e.meta["infra_error"] for e in failed)
    assert not [e for e in episodes if e.status.value == "running"]
    assert sum(len(e.calls) for e in built.pool.episodes()) == built.gateway.stats.calls_recorded
    assert m.get("rollout/infra_failures", 0) == len(failed)
