"""The simulator's speculative-decoding speed model: cheaper tokens where decoding is bound by reading
weights (small batches), none at compute-bound batches, and a shorter simulated tail. ~10 s."""

from __future__ import annotations

from arborl.config import load_config
from arborl.sim import cost_model, simulate
from arborl.sim.cost import CostModel

SMALL = ["sim.prompts=16", "sim.group_size=4", "sim.instances=2", "sim.length_median=400", "sim.max_tokens=4096",
         "sim.steps=1", "sim.policies=sync/pinned"]


def test_spec_factor_follows_acceptance_and_batch():
    plain = CostModel()
    assert plain.spec_factor(1) == 1.0 and plain.step_s(4, 1000) == CostModel().step_s(4, 1000)
    spec = CostModel(spec_acceptance=0.7, spec_max_k=4)
    # memory-bound batch: a verify step costs ~ a decode step and yields 1 + .7 + .49 + ... tokens
    assert abs(spec.spec_factor(1) - 1 / (1 + 0.7 + 0.49 + 0.343 + 0.2401)) < 0.01
    assert spec.spec_factor(1) < spec.spec_factor(256) < 1.0
    # compute-bound: per-sequence cost dominates, drafting does not pay and the rule turns it off
    heavy = CostModel(decode_base_s=0.001, decode_per_seq_s=1e-3, spec_acceptance=0.5)
    assert heavy.spec_factor(256) == 1.0
    assert CostModel(spec_acceptance=0.3).spec_factor(1) > spec.spec_factor(1)
    assert CostModel(spec_acceptance=0.7, spec_max_k=1).spec_factor(1) > spec.spec_factor(1)  # fewer drafts
    # the closed forms stay consistent: steps_within inverts steps_s
    t = spec.steps_s(8, 5000, 100)
    assert spec.steps_within(8, 5000, t) == 100


def test_simulated_tail_shrinks_with_speculation():
    cfg = load_config(None, SMALL)
    base = simulate(cfg)["policies"]["sync/pinned"]
    spec_cfg = load_config(None, [*SMALL, "sim.spec_acceptance=0.6", "sim.spec_max_k=3"])
    assert cost_model(spec_cfg.sim).spec_acceptance == 0.6
    spec = simulate(spec_cfg)["policies"]["sync/pinned"]
    assert spec["generated_tokens"] == base["generated_tokens"]  # the same work ...
    assert spec["tail_s"] < 0.7 * base["tail_s"] and spec["time_s"] < base["time_s"]  # ... done faster
