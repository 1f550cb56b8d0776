"""The suite's "no process left behind" check (tests/conftest.py): a session that leaves a daemon running
fails, naming it (and kills it); one whose processes all ended passes; processes that ran before the
session are never counted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

LEAKY = """
import subprocess, sys

def test_leaves_a_daemon():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # arborl-leftover-probe"],
                     start_new_session=True)  # reparented to init when this session ends

def test_cleans_up():
    p = subprocess.Popen(["sleep", "600"])
    p.kill()
    p.wait()
"""


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_body.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("ARBORL_TEST_SESSION", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_body.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def _probes() -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"arborl-leftover-probe" in open(f"/proc/{pid}/cmdline", "rb").read():
                out.append(int(pid))
        except OSError:
            pass
    return out


def test_a_session_that_leaves_a_process_running_fails_and_kills_it(tmp_path):
    r = _session(tmp_path, LEAKY)
    assert r.returncode != 0, r.stdout
    assert "still running at its end (now killed)" in r.stdout and "arborl-leftover-probe" in r.stdout, r.stdout
    assert _probes() == []


def test_a_clean_session_passes_beside_a_process_started_before_it(tmp_path):
    older = subprocess.Popen(["sleep", "600"], start_new_session=True)  # ours, but older than that session
    try:
        r = _session(tmp_path, LEAKY.replace("def test_leaves_a_daemon", "def _not_a_test"))
    finally:
        older.kill()
        older.wait()
    assert r.returncode == 0, r.stdout + r.stderr
