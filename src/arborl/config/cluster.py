"""Deployment (cluster/): local or Ray, actors, resources, weight sync, prefill/decode."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from arborl.config.base import Section, comma_list


class ClusterConfig(Section):
    """Where the run's parts live: in this process (local) or as Ray actors (docs/cluster.md)."""

    backend: Literal["local", "ray"] = Field(
        "local",
        description="local = every engine in this process; ray = each engine replica is a Ray actor (its own "
        "process) in a placement group, behind the same engine pool and gateway",
    )
    address: str | None = Field(
        None,
        description="Ray cluster to join (`auto`, `host:port`, `ray://host:port`); unset = start a local one for "
        "the run and stop it afterwards",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs a local Ray cluster started for the run declares (unset = all of this machine's)"
    )
    engine_cpus: float = Field(1.0, gt=0, description="CPUs reserved per engine actor (its placement-group bundle; torch threads)")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs reserved per engine actor (fractions share one GPU)")
    trainer_restarts: int = Field(
        0, ge=0,
        description="0 = the trainer, controller and gateway run in the `arborl train` process; N > 0 = they run in "
        "a Ray trainer actor that, when it dies, is started again from the last checkpoint up to N times",
    )
    trainer_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the trainer actor (cluster.trainer_restarts > 0)")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the trainer actor (cluster.trainer_restarts > 0)")
    rank_cpus: float = Field(
        1.0, ge=0, description="CPUs reserved per trainer rank actor (train.parallel.ranks > 1: one placement-group "
        "bundle each; its torch threads are train.parallel.threads_per_rank)")
    rank_gpus: float = Field(
        0.0, ge=0, description="GPUs reserved per trainer rank actor (train.parallel.ranks > 1; 1 = a GPU of its own, "
        "which NCCL needs)")
    worker_cpus: float = Field(
        0.5, ge=0,
        description="CPUs reserved per rollout worker actor (rollout.workers > 0; agents and sandboxes mostly wait "
        "on the engines; 0 = no reservation, no placement group)",
    )
    engine_nodes: list[str] = Field(
        default_factory=list,
        description="custom Ray resources naming the nodes the engine actors go on (a node started with "
        "`--resources '{\"NAME\": 1}'`): engine i asks for a sliver of the (i mod len)-th; empty = wherever "
        "cluster.placement_strategy puts it; on the command line a comma-separated list",
    )
    worker_nodes: list[str] = Field(
        default_factory=list,
        description="custom Ray resources naming the nodes the rollout worker actors go on (worker i: the (i mod "
        "len)-th, see cluster.engine_nodes); empty = anywhere",
    )
    rank_nodes: list[str] = Field(
        default_factory=list,
        description="custom Ray resources naming the nodes the trainer rank actors go on (rank i: the (i mod len)-th, "
        "see cluster.engine_nodes; torch.distributed's MASTER_ADDR and LOCAL_RANK follow); empty = anywhere",
    )
    trainer_node: str | None = Field(
        None,
        description="custom Ray resource naming the node the trainer actor goes on (cluster.trainer_restarts > 0; "
        "see cluster.engine_nodes); unset = anywhere",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the engine bundles"
    )
    placement_timeout_s: float = Field(
        120.0, gt=0,
        description="longest wait for the placement group and the actors to be ready, then a clear error (seconds)",
    )
    max_restarts: int = Field(
        3, ge=0,
        description="times Ray restarts an engine actor that died; a restarted one loads the latest weights and rejoins",
    )
    weight_sync: Literal["object_store", "safetensors", "collective"] = Field(
        "object_store",
        description="how new weights reach the engine actors: object_store = one ray.put per version, every "
        "actor reads it; safetensors = one file per version in cluster.shared_dir (storage every node sees); "
        "collective = torch.distributed broadcast from the driver (NCCL on GPUs, gloo on CPU)",
    )
    shared_dir: str | None = Field(
        None, description="directory for weight_sync=safetensors (unset = <run_dir>/weights); must be shared by all nodes"
    )
    pd_prefill_engines: int = Field(
        0, ge=0,
        description="prefill/decode disaggregation: the first N engines only prefill prompts, the others decode "
        "from the KV moved to them (0 = colocated: every engine does both)",
    )

    @field_validator("engine_nodes", "worker_nodes", "rank_nodes", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return comma_list(value)  # --set cluster.rank_nodes=node_a,node_b
