"""One trainer face (train/face.py), as the engines have one: every trainer kind -- one process, ranks
as subprocesses, ranks as Ray actors -- shows the whole TrainerFace; ``run.assemble.make_trainer``
chooses the kind from the config; the controller and the job drive a trainer only through the face (a
save / load round trip, the step's log-probs, the weights to publish), and never import a concrete one."""

from __future__ import annotations

import pytest
import torch

from arborl.config import ClusterConfig, TrainConfig
from arborl.run.assemble import make_trainer, trainer_class
from arborl.train.face import TrainerFace
from arborl.train.ranks import RankGroup
from arborl.train.trainer import Trainer
from helpers.imports import concrete_uses
from helpers.parallel import make_samples, tiny

CONCRETE = {"Trainer", "RankGroup", "RayRankGroup"}
CONSUMERS = ["run/controller.py", "scheduling", "gateway", "agents", "workers", "datapool"]


def _members(proto: type) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")} | set(getattr(proto, "__annotations__", {}))


INSTANCE_ATTRIBUTES = {"step", "policy", "step_logprobs"}  # Trainer sets them in __init__: checked on live trainers


def test_every_trainer_class_has_the_whole_face():
    from arborl.cluster.rank_actors import RayRankGroup

    for cls in (Trainer, RankGroup, RayRankGroup):
        need = _members(TrainerFace) - (INSTANCE_ATTRIBUTES if cls is Trainer else {"step"})
        missing = sorted(n for n in need if not hasattr(cls, n))
        assert not missing, f"{cls.__name__} lacks {missing}"


def test_make_trainer_chooses_every_kind_from_the_config():
    from arborl.cluster.rank_actors import RayRankGroup

    ranks = {"ranks": 2, "strategy": "ddp"}
    assert trainer_class(TrainConfig()) is Trainer
    assert trainer_class(TrainConfig(), ClusterConfig(backend="ray")) is Trainer  # one process needs no actors
    assert trainer_class(TrainConfig(parallel=ranks)) is RankGroup
    assert trainer_class(TrainConfig(parallel=ranks), ClusterConfig(backend="local")) is RankGroup
    assert trainer_class(TrainConfig(parallel=ranks), ClusterConfig(backend="ray")) is RayRankGroup


@pytest.mark.parametrize("parallel", [None, {"ranks": 2, "strategy": "ddp"}], ids=["one-process", "ranks"])
def test_a_trainer_of_each_kind_works_through_the_face_alone(tmp_path, parallel):
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=40, **({"parallel": parallel} if parallel else {}))
    trainer = make_trainer(tiny(), cfg)
    try:
        assert isinstance(trainer, TrainerFace)
        assert not [n for n in _members(TrainerFace) if not hasattr(trainer, n)]
        metrics = trainer.train_step(make_samples(4))
        assert "loss/total" in metrics and trainer.step == 1
        assert isinstance(trainer.step_logprobs, dict)
        if parallel is None:
            assert trainer.step_logprobs and trainer.policy is not None
        state = trainer.engine_state()
        assert state and all(isinstance(v, torch.Tensor) for v in state.values())
        assert trainer.adapter_state() is None  # no LoRA: the publisher sends engine_state
        saved = trainer.save(tmp_path / "ckpt", {"step": 1, "note": "face"})
        assert (saved / "config.json").is_file()  # a checkpoint is an HF directory whatever the kind
    finally:
        trainer.close()
    again = make_trainer(tiny(), cfg)
    try:
        assert again.load(tmp_path / "ckpt") == {"step": 1, "note": "face"} and again.step == 1
        after = again.engine_state()
        assert all(torch.equal(after[k], state[k]) for k in state)
    finally:
        again.close()


def test_no_trainer_consumer_imports_a_concrete_trainer_class():
    bad = concrete_uses(CONSUMERS, CONCRETE)
    assert not bad, bad
