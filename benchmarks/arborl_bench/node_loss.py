"""Node loss on a multi-node Ray cluster on one host (issue 49, deliverable 3; ``arborl bench faults``).

Several raylets on this machine, as Ray's own tests simulate nodes (``ray.cluster_utils.Cluster``), each
with a custom resource naming it: ``node_head`` (the trainer actor, with the controller, gateway and
data pool), ``node_a`` (the engine and trainer rank 0) and ``node_b`` (the rollout worker and trainer
rank 1). The tiny job (``cluster.trainer_restarts=1``, a checkpoint every step, two DDP ranks) runs on it;
when the first episode of step 2 ends, its agent (``hold_agent.py``) holds it open on ``node_b``, and
``node_b`` is removed: its raylet and every process on it SIGKILLed, mid-step. A fresh raylet with the
same resource then joins (the node returns). The run must finish; ``node_loss_episodes_lost`` = the
committed episodes the run never trained (``datapool/ledger.exactly_once``'s ``episodes_dropped``) plus
those finished before the kill that the data pool lacks after.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from arborl_bench import hold_agent
from arborl_bench.figures import figure_table

TINY = ["seed=3", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=1", "model.tiny_hidden=32",
        "engine.max_seq_len=512", "engine.max_batch_size=16", "rollout.task=even_tokens", "rollout.batch_tasks=4",
        "rollout.group_size=4", "rollout.max_tokens=8", "rollout.eval_tasks=0", "train.lr=0.1",
        "scheduling.timeline=false", "report.curves=false"]
# where each part goes: the custom resource of its node (cluster.*_nodes)
PLACEMENT = ["cluster.backend=ray", "cluster.trainer_restarts=1", "cluster.trainer_cpus=0.5", "cluster.trainer_node=node_head",
             "gateway.num_engines=1", "cluster.engine_cpus=1", "cluster.engine_nodes=node_a",
             "rollout.workers=1", "cluster.worker_cpus=0.5", "cluster.worker_nodes=node_b",
             "train.parallel.ranks=2", "train.parallel.strategy=ddp", "cluster.rank_cpus=0.25",
             "cluster.rank_nodes=node_a,node_b", "cluster.placement_timeout_s=90", "rollout.checkpoint_every=1"]
NODES = {"node_head": 1, "node_a": 2, "node_b": 1}  # name -> CPUs it declares
KILLED = "node_b"
OBJECT_STORE = 100 * 1024**2  # per node: the tiny model's weights are a few MB


@contextmanager
def one_host_cluster(nodes: dict[str, float] = NODES) -> Iterator[Any]:
    """A Ray cluster of one raylet per entry of ``nodes`` on this machine (the first is the head), each
    with ``{name: 1}`` as its custom resource; this process is connected to it. Everything is stopped after."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    from arborl.cluster.session import WORKER_NICENESS

    (head, head_cpus), *rest = nodes.items()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "resources": {head: 1}, "include_dashboard": False, "object_store_memory": OBJECT_STORE,
        "_system_config": {"worker_niceness": WORKER_NICENESS}})
    try:
        for name, cpus in rest:
            add_node(cluster, name, cpus)
        ray.init(address=cluster.address, logging_level="warning")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def add_node(cluster: Any, name: str, cpus: float) -> Any:
    return cluster.add_node(num_cpus=cpus, resources={name: 1}, object_store_memory=OBJECT_STORE)


def node_names() -> dict[str, str]:
    """Ray node id -> the custom resource naming it, for the nodes alive now."""
    import ray

    return {n["NodeID"]: next((r for r in n["Resources"] if r.startswith("node_")), "?")
            for n in ray.nodes() if n["Alive"]}


def actors_by_node() -> dict[str, list[str]]:
    """Live actors' classes per node name (Ray's actor table, read from the GCS: no dashboard needed)."""
    from ray._private import state

    names = node_names()
    out: dict[str, list[str]] = {}
    for a in state.actors().values():
        if a["State"] == "ALIVE":
            out.setdefault(names.get(a["Address"]["NodeID"], "?"), []).append(a["ActorClassName"])
    return {k: sorted(v) for k, v in sorted(out.items())}


class _Lines(logging.Handler):
    """The supervisor's log lines (``the trainer actor died ... restart 1 of 1``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _finished_ids(pool_file: Path) -> set[str]:
    if not pool_file.is_file():
        return set()
    with sqlite3.connect(pool_file) as db:
        return {r[0] for r in db.execute("select episode_id from episodes where status = 'finished'")}


def _wait(cond: Any, timeout_s: float, what: str, alive: threading.Thread | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if alive is not None and not alive.is_alive():
            raise RuntimeError(f"the run ended before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.1)


def run_node_loss(quick: bool, console: Console, work: Path | None = None) -> dict[str, Any]:
    from arborl.config import load_config
    from arborl.datapool import DataPool
    from arborl.datapool.ledger import exactly_once
    from arborl.run import job
    from arborl.run.rundir import RunDir

    steps = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="arborl-bench-nodes-") as tmp:
        work = Path(work or tmp)
        agent_dir = work / "agent"
        per_step = 16  # rollout.batch_tasks x rollout.group_size
        cfg = load_config(None, [f"runs_dir={work}", "name=nodes", *TINY, *PLACEMENT, f"rollout.steps={steps}",
                                 hold_agent.install(agent_dir, at=per_step + 1)])
        run = RunDir(cfg.run_dir, cfg.datapool)
        lines = _Lines()
        sup_log = logging.getLogger("arborl.cluster.supervise")
        sup_log.addHandler(lines)
        out: dict[str, Any] = {"node_loss_nodes": len(NODES), "node_loss_killed": KILLED}
        t0 = time.perf_counter()
        result: dict[str, Any] = {}
        try:
            with one_host_cluster() as cluster:
                def train() -> None:
                    try:
                        result["summary"] = job.train(cfg, console=Console(file=io.StringIO()))
                    except BaseException as e:  # noqa: BLE001 - reported below
                        result["error"] = e

                thread = threading.Thread(target=train, daemon=True)
                thread.start()
                _wait(lambda: hold_agent.reached(agent_dir), 300, "held episode in step 2", thread)
                out["node_loss_placement"] = actors_by_node()
                committed_before = _finished_ids(run.datapool_file)
                out["node_loss_checkpoint_at_kill"] = run.has_checkpoint()
                logged_at_kill = run.logged_steps()
                victim = next(n for n in cluster.worker_nodes if node_names().get(n.node_id) == KILLED)
                t_kill = time.perf_counter()
                cluster.remove_node(victim)  # its raylet and every process on it, SIGKILLed
                import ray

                _wait(lambda: not any(n["NodeID"] == victim.node_id and n["Alive"] for n in ray.nodes()), 60,
                      "node death seen by the GCS")
                add_node(cluster, KILLED, NODES[KILLED])  # the node returns: a fresh raylet with its resource
                _wait(lambda: run.logged_steps() > logged_at_kill, 300, "step after the node loss", thread)
                out["node_loss_recovery_s"] = round(time.perf_counter() - t_kill, 1)
                out["node_loss_placement_after"] = actors_by_node()
                thread.join(timeout=300)
        finally:
            sup_log.removeHandler(lines)
        from arborl.cluster.session import leftover_processes

        out["node_loss_ray_processes_left"] = len(leftover_processes())
        summary = result.get("summary") or {}
        out["node_loss_run_finished"] = "error" not in result and summary.get("steps") == steps
        if "error" in result:
            out["node_loss_error"] = f"{type(result['error']).__name__}: {result['error']}"
        out["node_loss_restarts"] = sum("the trainer actor died" in line for line in lines.lines)
        with DataPool(run.datapool_file) as pool:
            counts = exactly_once(pool)
        missing = len(committed_before - _finished_ids(run.datapool_file))
        with sqlite3.connect(run.datapool_file) as db:
            running = db.execute("select count(*) from episodes where status = 'running'").fetchone()[0]
        logged = [json.loads(x)["step"] for x in (run.path / "metrics.jsonl").read_text().splitlines() if x.strip()]
        out.update({
            "node_loss_episodes_lost": counts["episodes_dropped"] + missing,
            "node_loss_committed_before_kill": len(committed_before),
            "node_loss_committed_missing_after": missing,
            "node_loss_episodes_trained_twice": counts["episodes_trained_twice"],
            "node_loss_prompts_skipped": counts["prompts_skipped"],
            "node_loss_episodes_left_running": running,
            "node_loss_decoded_tokens_discarded": counts["decoded_tokens_discarded"],
            "node_loss_steps_logged": logged,
            "node_loss_steps": steps,
            "node_loss_s": round(time.perf_counter() - t0, 1),
        })
    console.print(figure_table("node loss (multi-node Ray cluster on one host)", out))
    return out
