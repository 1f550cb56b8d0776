"""Multi-node on one host: a Ray cluster of several raylets on this machine (``ray.cluster_utils.Cluster``,
as Ray's own tests simulate nodes), each named by a custom resource. ``cluster.rank_nodes`` and the other
``cluster.*_nodes`` knobs put each part on its node, torchrun's variables follow the placement; a node
removed mid-step (its raylet and every process on it killed) costs no committed episode and the run
finishes (``benchmarks/arborl_bench/node_loss.py``, also ``arborl bench faults``). Each test starts and
stops its own cluster; no Ray process is left."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from arborl_bench.node_loss import NODES, node_names, one_host_cluster, run_node_loss  # noqa: E402

from arborl.cluster.session import ClusterError, bundles, leftover_processes  # noqa: E402
from arborl.config import ClusterConfig, TrainConfig  # noqa: E402
from helpers.parallel import make_samples, rank_actor_processes, tiny  # noqa: E402


def _train() -> TrainConfig:
    return TrainConfig(lr=1e-3, micro_batch_tokens=40, parallel={"ranks": 2, "strategy": "ddp"})


def test_bundles_ask_for_their_nodes_resource_in_turn():
    assert bundles({"CPU": 1.0}, 3, ["node_a", "node_b"]) == [
        {"CPU": 1.0, "node_a": 0.001}, {"CPU": 1.0, "node_b": 0.001}, {"CPU": 1.0, "node_a": 0.001}]
    assert bundles({"CPU": 1.0}, 2, []) == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_rank_nodes_place_the_ranks_and_torchrun_variables_follow():
    from arborl.cluster.rank_actors import RayRankGroup

    samples = make_samples(5)
    seen = {}
    with one_host_cluster({"node_head": 1, "node_a": 1, "node_b": 1}):
        names = node_names()
        for order in (["node_a", "node_b"], ["node_b", "node_a"]):
            group = RayRankGroup(tiny(), _train(), ClusterConfig(backend="ray", rank_cpus=0.25, rank_nodes=order))
            try:
                loss = group.train_step(samples)["loss/total"]  # the ranks' gloo group spans the two nodes
                seen[tuple(order)] = ([names[p["node"]] for p in group.placement], group.placement, loss)
            finally:
                group.close()
        with pytest.raises(ClusterError, match="cluster.rank_nodes"):  # no node carries it: a clear error, no hang
            RayRankGroup(tiny(), _train(), ClusterConfig(backend="ray", rank_cpus=0.25, rank_nodes=["node_z"],
                                                          placement_timeout_s=2))
    for order, (on, placement, loss) in seen.items():
        assert on == list(order)  # the knob decides where each rank runs
        for r, p in enumerate(placement):  # one rank per node: each is local rank 0 of its node's one
            assert (p["RANK"], p["LOCAL_RANK"], p["LOCAL_WORLD_SIZE"], p["GROUP_RANK"], p["WORLD_SIZE"]) == (
                str(r), "0", "1", str(r), "2")
            assert p["MASTER_ADDR"] == placement[0]["ip"]
        assert placement[0]["node"] != placement[1]["node"]
    assert seen[("node_a", "node_b")][2] == pytest.approx(seen[("node_b", "node_a")][2])
    assert not rank_actor_processes() and leftover_processes() == []


def test_a_node_removed_mid_step_loses_no_committed_episode_and_the_run_finishes(tmp_path):
    out = run_node_loss(True, Console(file=io.StringIO()), work=tmp_path)
    assert out.get("node_loss_error") is None and out["node_loss_run_finished"], out
    # each part on its node, as cluster.trainer_node / engine_nodes / worker_nodes / rank_nodes say
    assert out["node_loss_placement"] == {"node_a": ["EngineActor", "RankActor"], "node_b": ["RankActor", "WorkerActor"],
                                          "node_head": ["TrainerActor"]}, out
    assert out["node_loss_checkpoint_at_kill"] and out["node_loss_restarts"] == 1
    assert out["node_loss_episodes_lost"] == 0 and out["node_loss_committed_before_kill"] >= 16  # step 1 at least
    assert out["node_loss_episodes_trained_twice"] == 0 and out["node_loss_prompts_skipped"] == 0
    assert out["node_loss_episodes_left_running"] == 0 and out["node_loss_steps_logged"] == [1, 2, 3]
    assert out["node_loss_nodes"] == len(NODES) and out["node_loss_ray_processes_left"] == 0
