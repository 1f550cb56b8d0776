"""The runtime's queue for real (bubblewrap sandboxes, no mocks): starts that find the host's limit reached
wait for room instead of failing, the wait is reported, and nothing is left behind.

No verdict depends on speed: each test waits on a condition (workspaces queued, commands started) that
must come true, and only then frees what the queued starts wait for."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arborl.config import EnvsConfig
from arborl.envs import InfraError, make_runtime
from arborl.envs.leftovers import leftovers, shm_files

NOTHING_LEFT = {"processes": 0, "mounts": 0, "uids": 0, "workspaces": 0, "shm_files": 0}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the uid pool is used as root only")


def _template(tmp: Path) -> Path:
    t = tmp / "template"
    t.mkdir(exist_ok=True)
    (t / "a.txt").write_text("a\n")
    return t


async def until(condition, what: str, timeout_s: float = 120.0) -> None:  # noqa: ANN001
    """Wait until ``condition()`` holds (a state that must come, not a guess at how long it takes)."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"never: {what}") from None


@root_only
def test_sandbox_queue_under_a_uid_limit_set_low_by_a_knob(tmp_path):
    rt = make_runtime(EnvsConfig(root_dir=str(tmp_path / "root"), sandbox_uid_base=70300, sandbox_uids=2))
    tpl, shm_before = _template(tmp_path), shm_files()
    live, most_live, uids_seen = [0], [0], set()

    async def episode(i: int, go: asyncio.Event) -> tuple[float, str]:
        ws = await rt.prepare(tpl, episode_id=f"q{i}")
        live[0] += 1
        most_live[0] = max(most_live[0], live[0])
        try:
            r = await rt.run(ws, ["id", "-u"])
            assert r.returncode == 0, r
            uids_seen.add(int(r.stdout))
            await go.wait()  # the first two hold both uids until the other four are queued
        finally:
            live[0] -= 1
            await rt.close(ws)
        return ws.extra["queue_wait_s"], r.stdout.strip()

    async def go_all():
        go = asyncio.Event()
        tasks = [asyncio.ensure_future(episode(i, go)) for i in range(6)]
        await until(lambda: rt.queue.waiting == 4 and live[0] == 2, "two workspaces live, four queued for their uids")
        go.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(go_all())
    waits = sorted(w for w, _ in results)
    assert waits[:2] == [0.0, 0.0] and all(w > 0 for w in waits[2:])  # four waited, and how long is reported
    stats = rt.queue.stats()
    assert stats["waits"] == 4 and stats["waiting"] == 0 and stats["gave_up"] == 0
    assert stats["wait_s_max"] == pytest.approx(max(waits), abs=1e-3)
    assert most_live[0] == 2 and uids_seen == {70300, 70301}  # never more live than uids, never a shared uid
    assert leftovers(rt, shm_before) == NOTHING_LEFT


@root_only
def test_sandbox_wait_s_bounds_the_wait_and_0_fails_at_once(tmp_path):
    tpl, shm_before = _template(tmp_path), shm_files()

    def rt_with(wait_s: float):  # noqa: ANN202
        return make_runtime(EnvsConfig(root_dir=str(tmp_path / f"root-{wait_s}"), sandbox_uid_base=70310,
                                       sandbox_uids=1, sandbox_wait_s=wait_s))

    async def go():
        held_rt = rt_with(300)
        held = await held_rt.prepare(tpl, episode_id="held")  # the only uid
        for wait_s in (0, 0.2):  # fails at once; gives up after its wait
            rt = rt_with(wait_s)
            with pytest.raises(InfraError, match=rf"sandbox_uids.*sandbox_wait_s={wait_s}"):
                await rt.prepare(tpl, episode_id="late")
            assert rt.queue.stats()["gave_up"] == 1 and rt.queue.stats()["waits"] == (1 if wait_s else 0)
        queued = asyncio.ensure_future(held_rt.prepare(tpl, episode_id="queued"))  # the default: it waits
        await until(lambda: held_rt.queue.waiting == 1, "the third workspace queued")
        await held_rt.close(held)
        ws = await queued
        assert ws.extra["queue_wait_s"] > 0
        await held_rt.close(ws)
        return held_rt

    held_rt = asyncio.run(go())
    assert leftovers(held_rt, shm_before) == NOTHING_LEFT


# in a process whose file descriptors are few (soft = hard limit, so the runtime cannot raise it): 24
# commands at once, each waiting for a file the host writes into its workspace once the commands that
# could start have and the rest are queued; every command then ends, the queued ones start as others end
FD_SCRIPT = r"""
import asyncio, json, sys
from pathlib import Path
from arborl.config import EnvsConfig
from arborl.envs import make_runtime
from arborl.envs.leftovers import leftovers, shm_files

tmp = Path(sys.argv[1])
rt = make_runtime(EnvsConfig(root_dir=str(tmp / "root"), sandbox_uid_base=70320, sandbox_uids=32))
tpl = tmp / "template"
shm_before = shm_files()
HOLD = ["sh", "-c", "touch up; while [ ! -e go ]; do sleep 0.01; done"]

async def main():
    wss = [await rt.prepare(tpl, episode_id=f"fd{i}") for i in range(24)]
    runs = [asyncio.ensure_future(rt.run(ws, HOLD, timeout_s=120)) for ws in wss]
    started = lambda: sum((ws.path / "up").exists() for ws in wss)
    while not (rt.queue.waiting >= 1 and started() + rt.queue.waiting == len(wss)):
        await asyncio.sleep(0.01)
    for ws in wss:
        (ws.path / "go").write_text("")
    results = await asyncio.gather(*runs)
    for ws in wss:
        await rt.close(ws)
    return results

results = asyncio.run(main())
print(json.dumps({"returncodes": [r.returncode for r in results], "queued": [r.queued_s for r in results],
                  "stats": rt.queue.stats(), "leftovers": leftovers(rt, shm_before)}))
"""


@root_only
def test_commands_queue_when_the_process_runs_short_of_file_descriptors(tmp_path):
    _template(tmp_path)
    r = subprocess.run(["prlimit", "--nofile=200:200", sys.executable, "-c", FD_SCRIPT, str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["returncodes"] == [0] * 24
    queued = [q for q in out["queued"] if q > 0]
    assert queued and out["stats"]["waits"] == len(queued) and out["stats"]["gave_up"] == 0
    assert out["leftovers"] == NOTHING_LEFT


@root_only
def test_leftovers_count_the_shm_files_a_sandbox_made_not_another_process(tmp_path):
    rt = make_runtime(EnvsConfig(root_dir=str(tmp_path / "root"), sandbox_uid_base=70330, sandbox_uids=2))
    before = shm_files()
    mine, other = Path("/dev/shm") / f"arborl-test-sandbox-{os.getpid()}", Path("/dev/shm") / f"arborl-test-other-{os.getpid()}"
    try:
        other.write_text("")  # a file another process of the host made meanwhile (root's)
        assert leftovers(rt, before)["shm_files"] == 0
        mine.write_text("")
        os.chown(mine, 70331, 70331)  # one a sandbox uid left behind
        assert leftovers(rt, before)["shm_files"] == 1
    finally:
        mine.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
