"""The unsandboxed runtime (``rollout.envs.runtime=local``): the same protocol with NO isolation.

Commands run as this user, in the workspace directory, with the same CPU, memory and file-size limits,
wall-clock timeout (the command's process group is killed) and output cap, but they can read and write
anything this user can, reach the network, and leave ``setsid`` processes behind (``close`` kills those
still working in the workspace directory; one that moved elsewhere it cannot tell from the host's own).
For trusted commands and machines without bubblewrap only; it is never chosen unless configured, and says
so loudly once per process.
"""

from __future__ import annotations

import logging
import os
import sys

from arborl.config import EnvsConfig
from arborl.envs.base import ENV_RUNTIMES, CommandResult
from arborl.envs.host import HostRuntime
from arborl.envs.proc import rlimit_prefix, run_process

log = logging.getLogger(__name__)
WARNING = (
    "rollout.envs.runtime=local: agent commands run WITHOUT A SANDBOX as this user, with access to this machine's "
    "files, processes and network; use rollout.envs.runtime=bwrap for anything untrusted"
)
_warned = False


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning(WARNING)
        print(f"WARNING: {WARNING}", file=sys.stderr)


@ENV_RUNTIMES.register("local")
class LocalRuntime(HostRuntime):
    name = "local"

    def __init__(self, cfg: EnvsConfig | None = None) -> None:
        super().__init__(cfg)
        _warn_once()

    def _kill_leftovers(self, ws) -> None:  # noqa: ANN001
        """Kill this user's processes whose working directory or root is in the workspace (daemons a
        command left: nothing contains them here)."""
        inside = str(ws.path)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                    continue
                places = [os.readlink(f"/proc/{pid}/cwd"), os.readlink(f"/proc/{pid}/root")]
            except OSError:
                continue
            if any(p == inside or p.startswith(inside + "/") for p in places):
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass

    async def _exec(self, ws, argv, *, timeout_s, env, stdin, unix_sockets) -> CommandResult:  # noqa: ANN001
        full_env: dict[str, str] = dict(os.environ)
        full_env.update(env or {})
        full_env["POSIXLY_CORRECT"] = "1"  # prlimit's option parsing stops at the command
        # RLIMIT_NPROC would count every process of this user, not the command's: left out here
        argv_full = rlimit_prefix(self.limits) + ["env", "-u", "POSIXLY_CORRECT", *argv]
        res = await run_process(
            argv_full,
            cwd=ws.path,
            env=full_env,
            stdin=stdin,
            wall_s=timeout_s if timeout_s is not None else self.limits.wall_s,
            output_bytes=self.cfg.output_kb * 1024,
            shown_argv=argv,
        )
        if res.killed is None and self._over_disk(ws):
            res.killed = "disk_limit"
        return res
