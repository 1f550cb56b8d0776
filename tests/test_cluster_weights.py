"""Weight sync payloads (cluster.weight_sync): a version is published once however many engines load
it; safetensors files on shared storage round-trip exactly (tied weights included) and an older
version's file is removed once a newer one is out; the knob picks the method; the collective
method's flat layout round-trips every dtype."""

from __future__ import annotations

import pytest
import torch

from arborl.cluster.deploy import make_publisher
from arborl.cluster.weights import WEIGHT_SYNC, SafetensorsSync, WeightPublisher, load_payload
from arborl.config import load_config


def _state():
    emb = torch.randn(32, 8)
    return {"embed.weight": emb, "lm_head.weight": emb, "layer.bias": torch.randn(8)}  # tied: one storage


def test_safetensors_round_trip_once_per_version_and_old_files_removed(tmp_path):
    pub = WeightPublisher(WEIGHT_SYNC.get("safetensors")(tmp_path / "w"))
    s1 = _state()
    p1 = pub.payload(s1, 1)
    assert pub.payload(s1, 1) == p1 and len(pub.publish_s) == 1  # every engine of the pool gets the same file
    got = load_payload(p1)
    assert set(got) == set(s1) and all(torch.equal(got[k], s1[k]) for k in s1)
    p2 = pub.payload(_state(), 2)
    assert pub.latest == (p2, 2)
    assert sorted(x.name for x in (tmp_path / "w").iterdir()) == ["policy-v2.safetensors"]
    pub.close()
    assert list((tmp_path / "w").iterdir()) == []


def test_the_knobs_pick_the_method_and_the_shared_directory(tmp_path):
    cfg = load_config(None, [f"runs_dir={tmp_path}", "name=r", "cluster.weight_sync=safetensors"])
    sync = make_publisher(cfg).sync
    assert isinstance(sync, SafetensorsSync) and sync.directory == tmp_path / "r" / "weights"
    shared = load_config(None, [f"runs_dir={tmp_path}", "cluster.weight_sync=safetensors", f"cluster.shared_dir={tmp_path / 'nfs'}"])
    pub = make_publisher(shared)
    pub.payload(_state(), 1)
    assert [x.name for x in (tmp_path / "nfs").iterdir()] == ["policy-v1.safetensors"]
    assert make_publisher(load_config(None, [])).sync.name == "object_store"  # the default
    assert make_publisher(load_config(None, ["cluster.weight_sync=collective"])).sync.name == "collective"
    assert sorted(WEIGHT_SYNC.names()) == ["collective", "object_store", "safetensors"]


def test_collective_layout_round_trips_mixed_dtypes_in_one_buffer_per_dtype():
    from arborl.cluster.collective import Layout

    state = {**_state(), "half.weight": torch.randn(3, 5).half(), "steps": torch.arange(4)}
    layout = Layout.of(state)
    flat = layout.flatten(state, "cpu")
    assert sorted(flat) == ["float16", "float32", "int64"]  # one broadcast per dtype
    assert flat["float32"].numel() == 32 * 8 * 2 + 8
    got = layout.unflatten(flat)
    assert all(got[k].dtype == state[k].dtype and torch.equal(got[k], state[k]) for k in state)
    empty = layout.empty("cpu")
    assert {k: (v.dtype, v.numel()) for k, v in empty.items()} == {k: (v.dtype, v.numel()) for k, v in flat.items()}


def test_an_actor_asked_for_a_version_it_missed_says_so():
    from arborl.cluster.collective import ActorSide, CollectivePayload, MissedBroadcast

    side = ActorSide()
    side.staged = (4, _state())
    with pytest.raises(MissedBroadcast):
        side.take(CollectivePayload(5))  # not broadcast to it, no object-store copy: its handle resends one
    assert set(side.take(CollectivePayload(4))) == set(_state()) and side.staged is None
