"""Scale out on Ray (``cluster.backend=ray``): engine replicas as Ray actors behind the engine pool,
weight sync through the object store, shared safetensors files or a gloo/NCCL broadcast
(``collective.py``), restarted engines rejoining at the current version, rollout workers as actors
(``workers.py``), the trainer as an actor resumed from its checkpoint (``supervise.py``), and
prefill/decode disaggregation (``pd.py``, also in-process). See docs/cluster.md."""

from arborl.cluster.pd import PDEngine, disaggregate
from arborl.cluster.session import ClusterError

__all__ = ["ClusterError", "PDEngine", "disaggregate", "deploy"]


def deploy(cfg, loaded, *, version: int = 0, run_dir=None):
    """The engines of ``cfg`` as Ray actors (``cluster.backend=ray``): a ``RayDeployment``."""
    from arborl.cluster.deploy import RayDeployment

    return RayDeployment(cfg, loaded, version=version, run_dir=run_dir)
