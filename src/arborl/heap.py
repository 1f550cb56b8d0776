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


@functools.cache
def _trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """``malloc_trim(0)``: True when glibc returned memory to the system."""
    trim = _trim()
    return bool(trim(0)) if trim is not None else False
