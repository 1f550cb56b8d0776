"""arborl.heap: freed tensors below glibc's mmap threshold stay resident until malloc_trim gives them back."""

from __future__ import annotations

import platform

import pytest
import torch

from arborl.heap import release_free_memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_freed_tensors_go_back_to_the_system():
    big = torch.ones(8 << 20)  # 32 MB, mmapped; freeing it raises glibc's mmap threshold to its size, so
    del big  # the blocks below come from the heap whatever the process did before
    held = [torch.ones(64 * 1024) for _ in range(2000)]  # 256 KB each, 0.5 GB
    keep = torch.ones(16)  # allocated after them: the heap's top is not free, so plain free() cannot shrink it
    before = _rss()
    del held
    freed_by_free = before - _rss()
    assert release_free_memory()
    freed_by_trim = before - _rss()
    assert freed_by_trim > freed_by_free + 200e6, (freed_by_free, freed_by_trim)
    assert keep.sum() == 16
