"""The bwrap runtime's reaper (``csrc/reaper.c``): every sandboxed command runs below it, so the sandbox's
init, which bubblewrap leaves behind unreaped, is reaped before the command's result is returned instead
of waiting as a zombie for the host's pid 1 (forever, where pid 1 is the trainer itself: a container's
entrypoint without an init).

Built with the system C compiler on first use, into the runtime's root directory, named by its source's
hash (processes share it; a changed source is a new build). Without a compiler the runtime runs without
it and says so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "reaper.c"
_COMPILERS = ("cc", "gcc", "clang", "g++")


def reaper_path(root: Path) -> str | None:
    """The built reaper under ``root`` (built now if missing), or None where no C compiler can build it."""
    src = SOURCE.read_bytes()
    out = root / f".reaper-{hashlib.sha256(src).hexdigest()[:16]}"
    if _ours(out):
        return str(out)
    compiler = next((c for c in _COMPILERS if shutil.which(c)), None)
    if compiler is None:
        _warn_once(
            "no C compiler (cc, gcc, clang) to build the sandbox's reaper: each sandboxed command leaves its "
            "sandbox's init for the host's pid 1 to reap; where pid 1 does not reap (a container started "
            "without an init), install gcc or start the container with --init"
        )
        return None
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    r = subprocess.run([compiler, "-O2", "-x", "c", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        _warn_once(f"the sandbox's reaper did not build with {compiler} ({r.stderr.strip()[-500:]}); commands run without it")
        return None
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)  # atomic: a process running the old file keeps it
    return str(out)


def _ours(path: Path) -> bool:
    """An executable this user built: never one another user put there (it runs outside the sandbox,
    as root where the job runs as root)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022 and bool(st.st_mode & 0o100)


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning(message)
