"""arborl's C++ CPU kernels (``engine/csrc``), compiled together into one library on first use.

``tree_attention.cpp``: decode / draft-verify attention (``engine.tree_attention``);
``row_linear.cpp``: projections at decode row counts (``engine.row_linear``). Built with the system
C++ compiler through torch's extension loader, cached on disk per CPU feature set (``-march=native``);
where it cannot be built, ``available()`` is False with the reason in ``build_error()`` and the engine
runs torch's own kernels.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("tree_attention.cpp", "row_linear.cpp")]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_tag() -> str:
    """The build uses -march=native: one build per CPU feature set (a shared home across machines)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def available() -> bool:
    """Build (once per process; the compiled library is cached on disk) and load the kernels.
    False, with the reason logged and kept in ``build_error()``, where they cannot be built."""
    with _lock:
        if "ok" not in _state:
            try:
                from torch.utils import cpp_extension

                cpp_extension.load(
                    name=f"arborl_cpu_kernels_{_cpu_tag()}",
                    sources=[str(s) for s in _SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                _state["ok"] = True
            except Exception as exc:  # no compiler / ninja / headers: the engine keeps torch's kernels
                _state["ok"] = False
                _state["error"] = f"{type(exc).__name__}: {exc}"
                log.warning("arborl's CPU kernels did not build (%s); the engine uses torch's kernels", exc)
        return bool(_state["ok"])


def build_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]
