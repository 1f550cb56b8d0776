"""cluster.trainer_restarts: `arborl train`'s trainer (with the controller, the gateway and the data pool
it owns) runs as a Ray actor; SIGKILLed after a checkpoint, the run goes on in a new actor from that
checkpoint and finishes with every step logged once; nothing the dead actor's gateway recorded is
lost (SQLite WAL) and no episode is left running. One local Ray session (ray.init(num_cpus=2)); no
Ray process is left."""

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
pytestmark = pytest.mark.slow  # a Ray session, a trainer actor and its engine actor, started twice

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import signal_agent  # noqa: E402
from helpers.tiny_run import tiny_cfg  # noqa: E402

from arborl.run import job  # noqa: E402
from arborl.cluster.session import ClusterError  # noqa: E402
from arborl.run.rundir import RunDir  # noqa: E402


def test_killed_trainer_actor_resumes_from_its_last_checkpoint(ray_session, tmp_path, caplog):
    # the trainer actor (it runs the episodes) kills itself as step 2's first episode ends: after step 1's
    # checkpoint and mid-run on any machine; never this process
    agent = signal_agent.install(tmp_path / "agent", "KILL", at=16 + 1, not_pid=os.getpid())
    cfg = tiny_cfg(tmp_path, "sup", "cluster.backend=ray", "cluster.trainer_restarts=1", "cluster.trainer_cpus=0.5",
                   "gateway.num_engines=1", "cluster.engine_cpus=1", "rollout.steps=4", "rollout.checkpoint_every=1",
                   agent)
    run = RunDir(cfg.run_dir, cfg.datapool)
    out: dict = {}

    def train() -> None:
        try:
            out["summary"] = job.train(cfg, console=Console(file=io.StringIO()))
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            out["error"] = e

    t = threading.Thread(target=train, daemon=True)
    t.start()
    t.join(timeout=400)
    assert not t.is_alive() and "error" not in out, out
    assert signal_agent.fired(tmp_path / "agent")
    assert out["summary"]["steps"] == 4
    assert "the trainer actor died" in caplog.text and "resuming from the last checkpoint (restart 1 of 1)" in caplog.text
    steps = [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert steps in (list(range(1, 5)), list(range(4))), steps  # each once: the resumed run truncated after its checkpoint
    with sqlite3.connect(run.datapool_file) as db:  # the first actor's records are still there
        statuses = dict(db.execute("select status, count(*) from episodes group by status").fetchall())
    assert statuses.get("running", 0) == 0 and statuses.get("finished", 0) >= 4 * 16


@pytest.mark.parametrize("knob", ["cluster.trainer_cpus=4", "cluster.trainer_gpus=1"])
def test_the_trainer_actor_reserves_its_knobs_resources_and_fails_fast_when_they_do_not_fit(ray_session, tmp_path,
                                                                                                 knob):
    """trainer_cpus / trainer_gpus are what the actor asks Ray for: more than the 2-CPU, GPU-less session
    holds is a ClusterError naming the knob, before any training starts."""
    cfg = tiny_cfg(tmp_path, "fit", "cluster.backend=ray", "cluster.trainer_restarts=1", knob,
                   "cluster.placement_timeout_s=3", "gateway.num_engines=1", "cluster.engine_cpus=1")
    with pytest.raises(ClusterError, match=knob.split(".", 1)[1]):  # e.g. "trainer_cpus=4"
        job.train(cfg, console=Console(file=io.StringIO()))
    assert not RunDir(cfg.run_dir, cfg.datapool).has_checkpoint()
