"""One meaning per ``scheduling.dispatch`` value: ``affinity`` is the engine pool's session placement
(engine/affinity.py, no dispatch policy); ``pinned`` and ``seer`` are dispatch policies, the same classes in
the engine pool (through the dispatcher) and in the simulator."""

from __future__ import annotations

import copy

import pytest

from arborl.config import Config, ConfigError, EngineConfig, SchedulingConfig, load_config
from arborl.engine import AsyncEngine, LLMEngine
from arborl.engine.pool import EnginePool
from arborl.models import tiny_llama
from arborl.scheduling.dispatch import PinnedDispatch, SeerDispatch
from arborl.sim import build_policies, simulate


@pytest.fixture
def engines():
    model = tiny_llama(layers=1, hidden=32, vocab=64, heads=2, kv_heads=1, seed=0)
    out = [AsyncEngine(LLMEngine(copy.deepcopy(model), EngineConfig(max_batch_size=2, max_seq_len=64, engine_id=f"e{i}"),
                                 eos_token_ids=[63])) for i in range(2)]
    yield out
    for e in out:
        e.shutdown()


def test_affinity_is_the_default_and_places_by_session_without_a_dispatcher(engines):
    pool = EnginePool.from_config(engines, SchedulingConfig())
    assert Config().scheduling.dispatch == "affinity" and pool.dispatcher is None
    a = pool.lease(session_id="s0", group_id="g", current=None, n=1)
    b = pool.lease(session_id="s0", group_id="g", current=a.index, n=1)
    assert (a.how, b.how, b.index) == ("new", "affinity", a.index)  # the session stays on its engine


@pytest.mark.parametrize("name, cls", [("pinned", PinnedDispatch), ("seer", SeerDispatch)])
def test_a_dispatch_policy_is_the_same_class_in_the_pool_and_in_the_simulator(engines, name, cls):
    pool = EnginePool.from_config(engines, SchedulingConfig(dispatch=name))
    assert type(pool.dispatcher.policy) is cls
    _, sim_dispatch = build_policies(SchedulingConfig(dispatch=name), "sync", name, batch_size=2, instances=2)
    assert type(sim_dispatch) is cls
    assert pool.lease(session_id="s0", group_id="g", current=None, n=1).how == "dispatch"


def test_abort_resume_takes_pinned_unless_told_otherwise_and_refuses_affinity(engines):
    assert SchedulingConfig(partial_rollout="abort_resume").dispatch == "pinned"
    assert load_config(None, ["scheduling.partial_rollout=abort_resume"]).scheduling.dispatch == "pinned"
    assert load_config(None, ["scheduling.partial_rollout=abort_resume",
                              "scheduling.dispatch=seer"]).scheduling.dispatch == "seer"
    pool = EnginePool.from_config(engines, SchedulingConfig(partial_rollout="abort_resume"))
    assert type(pool.dispatcher.policy) is PinnedDispatch and pool.abort_resume
    with pytest.raises(ConfigError, match="abort_resume .* set scheduling.dispatch=pinned"):
        load_config(None, ["scheduling.partial_rollout=abort_resume", "scheduling.dispatch=affinity"])


def test_the_simulator_refuses_affinity_naming_what_it_models():
    cfg = load_config(None, ["sim.policies=sync/affinity"])
    with pytest.raises(ConfigError, match="sim.policies: scheduling.dispatch=affinity is the engine pool's session "
                                          "placement .* take pinned .* or seer"):
        simulate(cfg)
