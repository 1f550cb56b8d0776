"""arborl's C++ CPU kernels (``engine/csrc``), compiled together into one library on first use.

``tree_attention.cpp``: decode / draft-verify attention (``engine.tree_attention``);
``row_linear.cpp``: projections at decode row counts (``engine.row_linear``); ``huge_pages.cpp``:
memory in 2 MB pages for what a decode step streams (``huge_zeros``). Built with the system
C++ compiler through torch's extension loader, cached on disk per CPU feature set (``-march=native``);
where it cannot be built, ``available()`` is False with the reason in ``build_error()`` and the engine
runs torch's own kernels.

Each kernel has a path per instruction set (``csrc/isa.h``: scalar, avx2, avx512f, avx512_bf16); the
library takes the best one the CPU reports (cpuid) when it loads, logs it, and ``isa()`` names it (the
engine bench records it). ``forced_isa(name)`` runs a lower path, which the tests compare with the best.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("tree_attention.cpp", "row_linear.cpp", "huge_pages.cpp", "decode_ops.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("isa.h", "numerics.h")]
# -fno-trapping-math: GCC vectorises the exp polynomials' loops only without FP traps (results unchanged)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_tag() -> str:
    """The build uses -march=native: one build per CPU feature set (a shared home across machines)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    # the sources' hash too: a changed kernel is a new library, never a stale cached one
    text = flags + " ".join(_CFLAGS) + "".join(p.read_text() for p in _SOURCES + _HEADERS)
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def available() -> bool:
    """Build (once per process; the compiled library is cached on disk) and load the kernels.
    False, with the reason logged and kept in ``build_error()``, where they cannot be built."""
    with _lock:
        if "ok" not in _state:
            try:
                import torch
                from torch.utils import cpp_extension

                cpp_extension.load(
                    name=f"arborl_cpu_kernels_{_cpu_tag()}",
                    sources=[str(s) for s in _SOURCES],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                _state["ok"] = True
                now, *has = torch.ops.arborl.kernel_isa("")
                log.info("arborl's CPU kernels: the %s path (this CPU has: %s)", now, ", ".join(has))
            except Exception as exc:  # no compiler / ninja / headers: the engine keeps torch's kernels
                _state["ok"] = False
                _state["error"] = f"{type(exc).__name__}: {exc}"
                log.warning("arborl's CPU kernels did not build (%s); the engine uses torch's kernels", exc)
        return bool(_state["ok"])


def build_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def isa() -> str | None:
    """The instruction-set path the kernels run (``scalar``, ``avx2``, ``avx512f``, ``avx512_bf16``);
    None where they did not build."""
    if not available():
        return None
    import torch

    return torch.ops.arborl.kernel_isa("")[0]


def isas() -> list[str]:
    """Every path this CPU can run, lowest first (empty where the kernels did not build)."""
    if not available():
        return []
    import torch

    return list(torch.ops.arborl.kernel_isa("")[1:])


def has_bf16() -> bool:
    """Whether the kernels have this CPU's bfloat16 dot products (AVX512-BF16) to run bf16 weights on."""
    return "avx512_bf16" in isas()


@contextmanager
def forced_isa(name: str) -> Iterator[None]:
    """Run the kernels' ``name`` path inside the block (a path this CPU has), then the one before."""
    import torch

    if not available():
        raise RuntimeError(f"arborl's CPU kernels did not build: {build_error()}")
    before = isa()
    torch.ops.arborl.kernel_isa(name)
    try:
        yield
    finally:
        torch.ops.arborl.kernel_isa(before)


def huge_zeros(shape: tuple[int, ...] | list[int], dtype: "torch.dtype") -> "torch.Tensor":
    """A zero-filled CPU tensor in 2 MB pages where it is >= 2 MB and the kernels built (else
    ``torch.zeros``): the weights and KV cache a decode step streams, with fewer TLB misses and the
    hardware prefetchers running across what were 4 KB page ends. Its memory is backed (and zeroed by
    the OS) as it is first touched."""
    import torch

    if not available():
        return torch.zeros(shape, dtype=dtype)
    return torch.ops.arborl.huge_zeros(list(shape), dtype)
