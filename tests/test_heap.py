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
