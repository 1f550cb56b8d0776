"""The data pool's disk full: the write that hit it raises a typed error saying what to do and stores
nothing; every record before it is intact (read back by another connection); once space is freed, the
same pool writes again. A real filesystem filled up: a small tmpfs (root only), unmounted after."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from arborl.datapool import DataPool, DataPoolFullError
from arborl.types import Call, Episode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _episode(pool: DataPool, i: int) -> str:
    ep = Episode(task_id=f"t{i}", group_id="g", agent_kind="whitebox")
    pool.put_episode(ep)
    pool.add_call(Call(episode_id=ep.episode_id, prompt_token_ids=list(range(300)), completion_token_ids=list(range(60)),
                       logprobs=[-0.5] * 60, sample_logprobs=[-0.5] * 60, versions=[0] * 60, finish_reason="stop"))
    return ep.episode_id


def test_a_full_disk_fails_the_write_alone_and_writing_resumes_once_space_is_freed(small_disk: Path):
    pool = DataPool(small_disk / "datapool.sqlite")
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (1536 * 1024))  # leave the pool a few hundred KiB
    stored = []
    with pytest.raises(DataPoolFullError, match="the disk is full .* free space on that filesystem"):
        for i in range(10_000):
            stored.append(_episode(pool, i))
    assert stored  # some fitted before the disk filled
    with DataPool(small_disk / "datapool.sqlite") as reader:  # what another process sees: every committed record
        got = {e.episode_id: e for e in reader.episodes()}
    assert set(stored) <= set(got)
    assert all(len(got[e].calls) == 1 for e in stored)
    filler.unlink()
    after = _episode(pool, -1)
    assert pool.get_episode(after) is not None and pool.count_episodes() >= len(stored) + 1
    pool.close()
