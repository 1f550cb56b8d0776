"""`arborl train --set cluster.backend=ray` as a user runs it: the job starts its own local Ray cluster,
trains on engine actors, and Ctrl-C (SIGINT) stops it after the step with a checkpoint and leaves no
Ray process (raylet, GCS server, workers) behind."""

from __future__ import annotations

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


@pytest.mark.slow
def test_ctrl_c_stops_a_ray_run_and_leaves_no_ray_process(tmp_path):
    assert leftover_processes() == []  # nothing of an earlier Ray session on this machine
    args = overrides(tmp_path, "r", "rollout.steps=50", "cluster.backend=ray", "cluster.num_cpus=2", "gateway.num_engines=2")
    proc = subprocess.Popen(arborl_cmd("train", *set_args(args)), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 1/"):
                proc.send_signal(signal.SIGINT)
                break
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + out
    assert proc.returncode == 130, text[-3000:]
    assert "Resume with" in text and (tmp_path / "r" / "checkpoint").is_dir()
    deadline = time.monotonic() + 30
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover_processes() == []
