"""The bwrap runtime reaps each sandbox's init itself: a process that runs sandboxes and never reaps
orphans (a trainer as a container's pid 1) collects no zombies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arborl.envs.reaper import reaper_path

# as a child subreaper (what a container's pid 1 is to orphans): three commands (one ends, one times out,
# one floods its output), then every orphan that came here counted, waiting for any still dying
_RUN_AS_SUBREAPER = r"""
import asyncio, ctypes, json, os, sys
from pathlib import Path
from arborl.config import EnvsConfig
from arborl.envs import make_runtime

assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
work, with_reaper = Path(sys.argv[1]), sys.argv[2] == "1"


async def commands():
    rt = make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(work / "envs"), output_kb=64))
    if not with_reaper:
        rt.reaper = None
    (work / "t").mkdir(exist_ok=True)
    ws = await rt.prepare(work / "t", episode_id="reap")
    try:
        ran = await rt.run(ws, ["sh", "-c", "sleep 30 & echo ok"])
        slow = await rt.run(ws, ["sleep", "30"], timeout_s=1)
        flood = await rt.run(ws, ["yes"])
    finally:
        await rt.close(ws)
    return {"ran": [ran.returncode, ran.stdout], "slow": [slow.returncode, slow.killed],
            "flood": [flood.returncode, flood.killed], "reaper": rt.reaper}


out = asyncio.run(commands())
orphans = 0
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
    orphans += 1
print(json.dumps({**out, "orphans": orphans}))
"""


def _as_subreaper(tmp_path, with_reaper: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", _RUN_AS_SUBREAPER, str(tmp_path), "1" if with_reaper else "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang", "g++")), reason="no C compiler here")
def test_no_sandbox_init_is_left_for_the_process_above_to_reap(tmp_path):
    got = _as_subreaper(tmp_path, with_reaper=True)
    assert got["reaper"] and got["orphans"] == 0
    assert got["ran"] == [0, "ok\n"]
    assert got["slow"] == [-9, "timeout"] and got["flood"] == [-9, "output_limit"]
    # the check itself: bubblewrap alone leaves one init per command to the process above
    assert _as_subreaper(tmp_path, with_reaper=False)["orphans"] == 3


def test_the_reaper_passes_the_programs_exit_on(tmp_path):
    reaper = reaper_path(tmp_path)
    if reaper is None:
        pytest.skip("no C compiler here")
    assert subprocess.run([reaper, "sh", "-c", "exit 3"]).returncode == 3
    assert subprocess.run([reaper, "sh", "-c", "kill -TERM $$"]).returncode == -15
    missing = subprocess.run([reaper, "no-such-program-here"], capture_output=True, text=True)
    assert missing.returncode == 127 and "no-such-program-here" in missing.stderr
    # what the program left running in the background (its output elsewhere) is waited for, not left behind
    subprocess.run([reaper, "sh", "-c", f"(sleep 0.3; touch {tmp_path / 'done'}) >/dev/null 2>&1 &"], check=True)
    assert (tmp_path / "done").exists()


def test_a_reaper_another_user_put_there_is_never_run(tmp_path):
    """The reaper runs outside the sandbox (as root where the job is root): a file of its name that this
    user did not build, or that others can write, is built over."""
    (tmp_path / "probe").mkdir()
    first = reaper_path(tmp_path / "probe")
    if first is None:
        pytest.skip("no C compiler here")
    built = Path(first).name
    for uid, mode in ((65534, 0o755), (os.geteuid(), 0o777)):
        root = tmp_path / f"root-{uid}-{mode:o}"
        root.mkdir()
        planted = root / built
        planted.write_text("#!/bin/sh\necho planted\n")
        os.chmod(planted, mode)
        if uid != os.geteuid():
            if os.geteuid() != 0:
                continue
            os.chown(planted, uid, uid)
        got = reaper_path(root)
        assert got == str(planted) and os.stat(got).st_uid == os.geteuid() and not os.stat(got).st_mode & 0o022
        assert "planted" not in subprocess.run([got, "true"], capture_output=True, text=True).stdout
