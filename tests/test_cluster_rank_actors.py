"""cluster.backend=ray places train.parallel's ranks as Ray actors in a placement group
(cluster/rank_actors.py): the same update as the ranks as child processes, torchrun's variables from
the placement, a clear error when the bundles do not fit, and no actor or placement group left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arborl.config import ClusterConfig, TrainConfig
from arborl.train.ranks import RankGroup
from helpers.parallel import make_samples, rank_actor_processes, tiny

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def _cfg() -> TrainConfig:
    return TrainConfig(lr=1e-3, packing="tree", micro_batch_tokens=40, grad_clip=0.5,
                       parallel={"ranks": 2, "strategy": "fsdp2"})


def test_rank_actors_train_like_rank_processes(ray_session):
    from arborl.cluster.rank_actors import RayRankGroup

    samples = make_samples(5)
    with RankGroup(tiny(), _cfg()) as local:
        want = [local.train_step(samples) for _ in range(2)]
    group = RayRankGroup(tiny(), _cfg(), ClusterConfig(backend="ray", rank_cpus=0.5))
    try:
        got = [group.train_step(samples) for _ in range(2)]
        ranks = group.run(getattr, "rank")  # torch.distributed's rank in each actor
        placement, pids = group.placement, group.pids
        parents = [int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in pids]
        pg_id = group.pg.id
    finally:
        group.close()
    for g, w in zip(got, want):
        assert g["loss/total"] == w["loss/total"] and g["train/grad_norm"] == w["train/grad_norm"]
    assert ranks == [0, 1]
    for r, (p, pid) in enumerate(zip(placement, pids)):  # Ray's worker processes, not this one's children
        assert p["pid"] == pid and parents[r] != os.getpid()
        assert (p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"], p["LOCAL_WORLD_SIZE"], p["GROUP_RANK"]) == (str(r), str(r), "2", "2", "0")
        assert p["MASTER_ADDR"] == placement[0]["ip"] == ray.util.get_node_ip_address()
    assert not rank_actor_processes()
    assert ray.util.placement_group_table().get(pg_id.hex(), {}).get("state") in (None, "REMOVED")


@pytest.mark.parametrize("knob", [{"rank_cpus": 1.5}, {"rank_gpus": 1.0}])  # 2 CPUs, no GPU in the session
def test_rank_bundles_that_do_not_fit_stop_with_the_knob_to_change(ray_session, knob):
    from arborl.cluster.rank_actors import RayRankGroup
    from arborl.cluster.session import ClusterError

    with pytest.raises(ClusterError, match="cluster.rank_cpus / rank_gpus") as err:
        RayRankGroup(tiny(), _cfg(), ClusterConfig(backend="ray", placement_timeout_s=3, **knob))
    bundle = {"CPU": knob.get("rank_cpus", 1.0), **({"GPU": 1.0} if "rank_gpus" in knob else {})}
    assert str(bundle) in str(err.value)
    assert not rank_actor_processes()
