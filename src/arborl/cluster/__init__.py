"""Scale out on Ray (``cluster.backend=ray``): engine replicas as Ray actors behind the engine pool,
weight sync through the object store, shared safetensors files or a gloo/NCCL broadcast
(``collective.py``), restarted engines rejoining at the current version, rollout workers as actors
(``workers.py``), the trainer as an actor resumed from its checkpoint (``supervise.py``), and
prefill/decode disaggregation (``pd.py``, also in-process). See docs/cluster.md."""

from arborl.cluster.pd import PDEngine, disaggregate
from arborl.cluster.session import ClusterError

# The engines as Ray actors: ``arborl.cluster.deploy.RayDeployment`` (no function of that module's name
# here: importing the submodule would replace it on the package).
__all__ = ["ClusterError", "PDEngine", "disaggregate"]
