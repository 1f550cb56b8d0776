"""train.parallel under cluster.trainer_restarts: a trainer rank (a Ray actor of the trainer actor's rank
group) SIGKILLed mid-run (as step 2's first episode ends) tears the rank group down; the supervisor starts
the run again from the last checkpoint (sharded, 2 FSDP2 ranks), the run finishes with every step once,
every committed episode is still in the data pool, and no rank process is left. One local Ray session
(2 CPUs)."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import signal_agent  # noqa: E402
from helpers.parallel import rank_actor_processes, rank_children  # noqa: E402
from helpers.tiny_run import tiny_cfg  # noqa: E402

from arborl.run import job  # noqa: E402
from arborl.run.rundir import RunDir  # noqa: E402


def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint(ray_session, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("ARBORL_TEST_OWNER", str(os.getpid()))
    agent = signal_agent.install(tmp_path / "agent", "KILL", at=16 + 1, not_pid=os.getpid(), target="rank")
    cfg = tiny_cfg(tmp_path, "ranks", "cluster.backend=ray", "cluster.trainer_restarts=1", "cluster.trainer_cpus=0.5",
                   "gateway.num_engines=1", "cluster.engine_cpus=1", "cluster.rank_cpus=0.25", "rollout.steps=3", "rollout.checkpoint_every=1",
                   "train.parallel.ranks=2", "train.parallel.strategy=fsdp2", "train.packing=tree", agent)
    run = RunDir(cfg.run_dir, cfg.datapool)
    out: dict = {}

    def train() -> None:
        try:
            out["summary"] = job.train(cfg, console=Console(file=io.StringIO()))
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            out["error"] = e

    t = threading.Thread(target=train, daemon=True)
    t.start()
    t.join(timeout=500)
    assert not t.is_alive() and "error" not in out, out
    assert signal_agent.fired(tmp_path / "agent")
    assert out["summary"]["steps"] == 3
    assert "the trainer actor died" in caplog.text and "resuming from the last checkpoint" in caplog.text
    steps = [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps
    with sqlite3.connect(run.datapool_file) as db:  # every committed episode is still there; none left running
        statuses = dict(db.execute("select status, count(*) from episodes group by status").fetchall())
    assert statuses.get("running", 0) == 0 and statuses.get("finished", 0) >= 3 * 16
    assert (run.checkpoint / "dcp").is_dir()
    assert not rank_children() and not rank_actor_processes()
