"""The Ray session of a run: joined (``cluster.address``) or started locally, and always stopped again.

A session the caller already opened (a test, a notebook) is used as it is and left open."""

from __future__ import annotations

import os
import subprocess
import uuid

from arborl.config import ClusterConfig
from arborl.types import ArborlError

WORKER_NICENESS = 0  # the actors of a local cluster run at the driver's priority (Ray's default is 15)


class ClusterError(ArborlError, RuntimeError):
    """The Ray cluster could not give the run what it asked for; the message says what to change."""


def ray_module():
    try:
        import ray
    except ImportError as e:
        raise ClusterError("cluster.backend=ray needs Ray: pip install 'arborl[ray]'") from e
    return ray


def start(cfg: ClusterConfig) -> bool:
    """Open the session; True when this call started it (and ``stop`` must end it)."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home from a training job
    kwargs = {"include_dashboard": False, "log_to_driver": True, "logging_level": "warning"}
    try:
        if cfg.address:
            ray.init(address=cfg.address, **kwargs)
        else:
            # Ray starts its workers at nice 15 by default: on a busy machine the engine and worker actors
            # (the job's main work) then starve behind any other process, and a step takes 10-20x longer.
            ray.init(num_cpus=cfg.num_cpus, _system_config={"worker_niceness": WORKER_NICENESS}, **kwargs)
    except ConnectionError as e:
        raise ClusterError(f"cannot join the Ray cluster at cluster.address={cfg.address!r}: {e}. Start it with "
                           "`ray start --head`, or unset cluster.address to start a local one") from e
    return True


def stop(started: bool) -> None:
    """End a session ``start`` opened: the local cluster's processes (raylet, GCS, workers) go with it."""
    if started:
        ray_module().shutdown()


def remove_pg(pg) -> None:  # noqa: ANN001 - a Ray PlacementGroup
    """Remove a placement group this run made; nothing if Ray is already down."""
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - Ray already down
        pass


NODE_SHARE = 0.001  # of a node's custom resource (cluster.*_nodes) one bundle asks for: a thousand fit a node of 1


def on_node(names: list[str] | str | None, i: int = 0) -> dict[str, float]:
    """The custom resource that puts bundle ``i`` on its node (``cluster.engine_nodes`` and the like: the
    ``i mod len``-th name); empty when no node is named."""
    if isinstance(names, str):
        names = [names]
    return {names[i % len(names)]: NODE_SHARE} if names else {}


def bundles(bundle: dict[str, float], n: int, nodes: list[str]) -> list[dict[str, float]]:
    """``n`` copies of ``bundle``, the i-th asking for its node's resource (``on_node``)."""
    return [{**bundle, **on_node(nodes, i)} for i in range(n)]


def placed_group(cfg: ClusterConfig, bundles: list[dict[str, float]], kind: str, *, what: str, lower: str):
    """A placement group of ``bundles`` (``cfg.placement_strategy``), placed within
    ``cfg.placement_timeout_s``; otherwise it is removed and a ClusterError says what the cluster has free
    and the knobs to ``lower``."""
    ray = ray_module()
    from ray.util.placement_group import placement_group

    pg = placement_group([dict(b) for b in bundles], strategy=cfg.placement_strategy, name=pg_name(kind))
    try:
        ray.get(pg.ready(), timeout=cfg.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_pg(pg)
        shown = bundles[0] if all(b == bundles[0] for b in bundles) else bundles
        raise ClusterError(
            f"the placement group of {len(bundles)} {what} bundles {shown} ({cfg.placement_strategy}) was not placed "
            f"within cluster.placement_timeout_s={cfg.placement_timeout_s:g} s; the cluster has "
            f"{ray.available_resources()} free: lower {lower}, or add nodes") from None
    return pg


def pg_name(kind: str) -> str:
    """A placement group's name: what it holds and the process that made it (``remove_orphans``)."""
    return f"arborl-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_orphans(pid: int) -> int:
    """Remove the placement groups a dead process made (Ray keeps them while the job lives); how many."""
    ray = ray_module()
    from ray.util.placement_group import get_placement_group, remove_placement_group

    n = 0
    for info in ray.util.placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith("arborl-") and f"-{pid}-" in name and info.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(name))
                n += 1
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
    return n


def leftover_processes() -> list[str]:
    """Ray's own daemons still running on this machine (what a clean shutdown leaves none of)."""
    out = subprocess.run(["ps", "-eo", "pid,comm,args"], capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines()[1:]
            if any(name in line.split(None, 2)[1] for name in ("raylet", "gcs_server"))]
