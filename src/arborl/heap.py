"""Give the memory that freed tensors leave in the C heap back to the operating system.

glibc keeps a freed block below its (dynamic, up to 32 MB) mmap threshold in the process's heap, so
a tensor freed after a phase -- the engine's dropped Linear weights, its released KV rows and prefix
cache, the warm start's optimizer state -- still counts as resident memory until ``malloc_trim`` runs:
measured on SmolLM2, 0.44 GB of an engine's 2.64 GB after it freed its Linear weights. Called where a
phase frees a lot (at most once per weight update), never per token or forward. A no-op where the C
library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@functools.cache
def _libc(name: str):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """``malloc_trim(0)``: True when glibc returned memory to the system."""
    trim = _libc("malloc_trim")
    return bool(trim(0)) if trim is not None else False


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (``train.malloc_mmap_threshold_mb``): every block at least
    that large is mmapped and goes back to the system when freed, and the threshold no longer climbs (up to
    32 MB) after such a block is freed, so a training step's large transients stop fragmenting the heap.
    0 keeps glibc's dynamic threshold. True when set."""
    mallopt = _libc("mallopt")
    return nbytes > 0 and mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))
