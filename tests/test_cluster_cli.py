"""`arborl train --set cluster.backend=ray` as a user runs it: the job starts its own local Ray cluster,
trains on engine actors (and, with cluster.trainer_restarts, in a trainer actor), and Ctrl-C (SIGINT)
stops it after the step with a checkpoint and leaves no Ray process (raylet, GCS server, workers)
behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.tiny_run import ENV, arborl_cmd, overrides, set_args  # noqa: E402

from arborl.cluster.session import leftover_processes  # noqa: E402


def _interrupt(args: list[str], marker: str, at_marker=lambda: None) -> tuple[int, str]:
    """``arborl train`` with ``args``, SIGINT once a line contains ``marker`` (``at_marker`` runs just
    before); its exit status and output."""
    proc = subprocess.Popen(arborl_cmd("train", *set_args(args)), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                at_marker()
                proc.send_signal(signal.SIGINT)
                break
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines) + out


def _no_ray_left(within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover_processes() == []



@pytest.mark.slow
def test_ctrl_c_stops_a_ray_run_and_leaves_no_ray_process(tmp_path):
    assert leftover_processes() == []  # nothing of an earlier Ray session on this machine
    args = overrides(tmp_path, "r", "rollout.steps=50", "cluster.backend=ray", "cluster.num_cpus=2", "gateway.num_engines=2")
    code, text = _interrupt(args, "step 1/")
    assert code == 130, text[-3000:]
    assert "Resume with" in text and (tmp_path / "r" / "checkpoint").is_dir()
    _no_ray_left()


def _actor_niceness() -> dict[str, int]:
    """The nice value of each of Ray's actor processes on this machine (``ray::ClassName``)."""
    out = subprocess.run(["ps", "-eo", "ni,args"], capture_output=True, text=True, check=True).stdout
    return {args: int(ni) for ni, args in (line.strip().split(None, 1) for line in out.splitlines()[1:])
            if args.startswith("ray::") and "Actor" in args}


@pytest.mark.slow
def test_ctrl_c_stops_the_trainer_actor_after_its_step_and_the_run_resumes(tmp_path):
    """With cluster.trainer_restarts the run is in a trainer actor: the driver passes Ctrl-C on, the actor
    stops after its step with a checkpoint (exit 130, as without Ray), no Ray process is left, and
    `arborl train --resume` finishes the run from that checkpoint (each step logged once). The actors of
    the cluster the job started run at the driver's priority (Ray's default nice 15 starves them)."""
    assert leftover_processes() == []
    args = overrides(tmp_path, "s", "rollout.steps=6", "rollout.checkpoint_every=1", "cluster.backend=ray",
                     "cluster.num_cpus=2", "gateway.num_engines=1", "cluster.engine_cpus=1", "cluster.trainer_restarts=1",
                     "cluster.trainer_cpus=1")
    niceness: dict[str, int] = {}
    # "step 1/6": the actor's output, forwarded by Ray
    code, text = _interrupt(args, "step 1/6", at_marker=lambda: niceness.update(_actor_niceness()))
    assert code == 130, text[-3000:]
    assert "stopped by SIGINT after step" in text and "Resume with" in text, text[-3000:]
    assert any("TrainerActor" in a for a in niceness) and any("EngineActor" in a for a in niceness), niceness
    assert set(niceness.values()) == {0}, niceness
    _no_ray_left()
    run = tmp_path / "s"
    done = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(x).get("kind") == "step"]
    assert (run / "checkpoint").is_dir() and 1 <= len(done) < 6, done

    resumed = subprocess.run(arborl_cmd("train", "--resume", str(run)), env=ENV, capture_output=True, text=True,
                             timeout=300, check=False)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("kind") == "step"]
    assert sorted(steps) == sorted(set(steps)) and len(steps) == 6, steps
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    _no_ray_left(60)
