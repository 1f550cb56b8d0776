"""arborl.heap: freed tensors below glibc's mmap threshold stay resident until malloc_trim gives them back.

Measured in a fresh Python process: in a test worker that has run other tests, torch's earlier threads may
have put the blocks in another malloc arena (which plain free() can shrink), so the figure would depend on
what ran before."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

_PROBE = """
import json
import torch
from arborl.heap import release_free_memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

big = torch.ones(8 << 20)  # 32 MB, mmapped; freeing it raises glibc's mmap threshold to its size, so
del big  # the blocks below come from the heap
held = [torch.ones(64 * 1024) for _ in range(2000)]  # 256 KB each, 0.5 GB
keep = torch.ones(16)  # allocated after them: the heap's top is not free, so plain free() cannot shrink it
before = rss()
del held
freed_by_free = before - rss()
trimmed = release_free_memory()
print(json.dumps({"free": freed_by_free, "trim": before - rss(), "trimmed": trimmed, "keep": float(keep.sum())}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_freed_tensors_go_back_to_the_system():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["trimmed"] and got["keep"] == 16
    assert got["trim"] > got["free"] + 200e6, got


_THRESHOLD_PROBE = """
import json, sys
import torch
from arborl.heap import set_mmap_threshold

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

fixed = set_mmap_threshold(int(sys.argv[1]) << 20)
big = torch.ones(5 << 20)  # 20 MB: mmapped either way; freed, it raises glibc's dynamic threshold to 20 MB
del big
keep = torch.ones(16)
again = torch.ones(5 << 20)  # 20 MB again: from the heap under the dynamic threshold, mmapped under a fixed 16 MB
keep2 = torch.ones(16)  # after it: the heap's top is not free
before = rss()
del again
print(json.dumps({"fixed": fixed, "returned": before - rss(), "keep": float(keep.sum() + keep2.sum())}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_fixed_mmap_threshold_returns_a_large_freed_block_at_once():
    """train.malloc_mmap_threshold_mb: with glibc's dynamic threshold a second 20 MB tensor comes from the heap and
    stays resident when freed; with the threshold fixed at 16 MB it is mmapped and goes back when freed."""
    got = {}
    for mb in (0, 16):
        out = subprocess.run([sys.executable, "-c", _THRESHOLD_PROBE, str(mb)], capture_output=True, text=True,
                             timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        got[mb] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got[0]["fixed"] is False and got[16]["fixed"] is True
    assert got[16]["returned"] > 18e6 and got[0]["returned"] < 2e6, got
