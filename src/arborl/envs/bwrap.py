"""The bubblewrap sandbox runtime (``rollout.envs.runtime=bwrap``, the default).

Each command is its own ``bwrap`` process: a read-only system (/usr, the few /etc files programs need,
the running Python), the workspace bound read-write at ``rollout.envs.workspace_path`` (the only writable place
besides a small private /tmp), its own PID, network (loopback only), IPC and UTS namespaces, a new
session, and death with its parent. As root the command runs as the workspace's own unprivileged uid
(``setpriv``, all capabilities dropped, no new privileges) so RLIMIT_NPROC caps that workspace's
processes; as another user each command has its own user namespace, and the cap, set inside it, counts
only that command's processes (never the trainer's threads or another sandbox's). CPU time, address
space and file size are set by ``prlimit`` on bwrap and inherited; the process cap by ``prlimit``
inside. When bwrap exits, its PID namespace goes, and with it every process the command started
(``setsid``, daemons): nothing outlives a command. Each command runs below a reaper (``envs/reaper.py``)
that reaps the sandbox's init, which bwrap leaves behind.

The kernel's shared state is closed as container runtimes close it: a seccomp filter (``envs/seccomp.py``,
``rollout.envs.seccomp``) refuses keyrings, ptrace, mounts, new namespaces, bpf, io_uring and the rest of
Docker's list; every command first joins a fresh anonymous session keyring (``keyctl session -``), so none
inherits the job's; ``/proc/sys``, ``/proc/sysrq-trigger`` and ``/proc/fs`` are read-only and
``/proc/keys``, ``/proc/kcore`` and friends read as empty files.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from arborl.config import EnvsConfig
from arborl.envs.base import (
    ENV_RUNTIMES,
    TRANSIENT_ERRNOS,
    CommandResult,
    EnvError,
    InfraError,
    ResourceBusy,
    SandboxUnavailableError,
    Workspace,
    is_transient,
)
from arborl.envs.host import HostRuntime, own_root
from arborl.envs.proc import rlimit_prefix, run_process
from arborl.envs.reaper import reaper_path
from arborl.envs.seccomp import program as seccomp_program
from arborl.envs.seccomp import program_fd as seccomp_fd
from arborl.envs.workspace import copy_tree, remove_tree

_ETC = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "nsswitch.conf",
    "mime.types", "os-release", "debian_version",
)  # fmt: skip
_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /proc inside: these read-only (as root bubblewrap itself covers /proc/irq and /proc/bus; as another user it
# leaves them, so they are added), these as empty files
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "fs")
_PROC_READ_ONLY_USER = ("irq", "bus")
_PROC_MASKED = ("keys", "key-users", "kcore", "timer_list", "sched_debug", "latency_stats")
KEYCTL = "/usr/bin/keyctl"
_JOINED = re.compile(r"\AJoined session keyring: -?\d+\n")  # what `keyctl session` says on stderr first
# how bwrap, the reaper or prlimit say a fork, clone, pipe or open failed for want of processes, descriptors
# or memory (strerror of TRANSIENT_ERRNOS): the sandbox did not start, and may a moment later
_TRANSIENT_TEXTS = tuple(os.strerror(e) for e in TRANSIENT_ERRNOS)
_FIX = (
    "install bubblewrap (`apt-get install -y bubblewrap` as root, or `make venv`), or, knowing that agent "
    "commands then run with NO isolation on this machine, opt in with `--set rollout.envs.runtime=local`"
)


@lru_cache(maxsize=None)
def check_bwrap(bwrap: str, reaper: str | None = None) -> str:
    """The bwrap executable, once it has started a minimal sandbox here (cached; under ``reaper`` when
    given, so the probe's sandbox init is reaped too); else SandboxUnavailableError saying how to fix it."""
    path = shutil.which(bwrap)
    if path is None:
        raise SandboxUnavailableError(f"bubblewrap ({bwrap!r}) is not installed: {_FIX}")
    user = [] if os.geteuid() == 0 else ["--unshare-user"]
    probe = ([reaper] if reaper else []) + [path, "--ro-bind", "/usr", "/usr", *_system_links(), "--proc", "/proc", "--dev", "/dev",
             "--unshare-pid", "--unshare-net", *user, "--die-with-parent", "--", "true"]  # fmt: skip
    try:
        r = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailableError(f"bubblewrap at {path} cannot start a sandbox ({e}): {_FIX}") from e
    if r.returncode != 0:
        raise SandboxUnavailableError(
            f"bubblewrap at {path} cannot start a sandbox here ({r.stderr.strip() or f'exit {r.returncode}'}); "
            "unprivileged user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone=1 / "
            f"user.max_user_namespaces), or: {_FIX}"
        )
    if shutil.which("prlimit") is None or (os.geteuid() == 0 and not os.path.exists("/usr/bin/setpriv")):
        raise SandboxUnavailableError("the sandbox needs prlimit and setpriv from util-linux: apt-get install -y util-linux")
    if not os.access(KEYCTL, os.X_OK):
        raise SandboxUnavailableError(
            f"the sandbox needs {KEYCTL} (keyutils: every command joins a fresh session keyring): "
            "apt-get install -y keyutils (or `make venv`)"
        )
    return path


_etc_made: dict[tuple[Path, int, int], Path] = {}


def build_etc(root: Path, cfg: EnvsConfig) -> Path:
    """The sandbox's /etc: copies of the few host files programs need, and a passwd/group naming the
    sandbox uids, in one directory under ``root`` (one mount instead of one per file: each mount is
    ~1 ms of every command's start). Named by its content's hash, so processes share it; made once
    per process and root."""
    key = (root, cfg.sandbox_uid_base, cfg.sandbox_uids)
    if key in _etc_made and _etc_made[key].is_dir():
        return _etc_made[key]
    _etc_made[key] = _build_etc(root, cfg)
    return _etc_made[key]


def _build_etc(root: Path, cfg: EnvsConfig) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=".etc-new-", dir=own_root(str(root))))
    try:
        for name in _ETC:
            src = Path("/etc") / name
            if src.is_symlink():
                os.symlink(os.readlink(src), staging / name)
            elif src.is_dir():
                (staging / name).mkdir()
                copy_tree(src, staging / name, uid=None)
            elif src.is_file():
                shutil.copyfile(src, staging / name)
        (staging / "empty").write_bytes(b"")  # bound over /proc/keys and friends
        users = ["root:x:0:0:root:/root:/bin/sh", "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin"]
        groups = ["root:x:0:", "nogroup:x:65534:"]
        for uid in range(cfg.sandbox_uid_base, cfg.sandbox_uid_base + cfg.sandbox_uids) if os.geteuid() == 0 else [os.getuid()]:
            users.append(f"sandbox{uid}:x:{uid}:{uid}:sandbox:/tmp:/bin/sh")
            groups.append(f"sandbox{uid}:x:{uid}:")
        (staging / "passwd").write_text("\n".join(users) + "\n")
        (staging / "group").write_text("\n".join(groups) + "\n")
        (staging / "hostname").write_text("sandbox\n")
        os.chmod(staging, 0o755)
        h = hashlib.sha256()
        for p in sorted(staging.rglob("*")):
            h.update(str(p.relative_to(staging)).encode())
            h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b"/")
        final = root / f".etc-{h.hexdigest()[:16]}"
        if final.exists():
            remove_tree(staging)
        else:
            try:
                os.rename(staging, final)
            except OSError:  # another process made it first
                remove_tree(staging)
        return final
    except BaseException:
        remove_tree(staging)
        raise


def _system_links() -> list[str]:
    """/bin, /lib, ... as the host has them: symbolic links into /usr, or read-only directories."""
    out = []
    for d in _SYSTEM_DIRS:
        host = Path("/") / d
        if host.is_symlink():
            out += ["--symlink", os.readlink(host), f"/{d}"]
        elif host.is_dir():
            out += ["--ro-bind", str(host), f"/{d}"]
    return out


def _python_dirs() -> list[Path]:
    """The running Python's installation and venv, where they are not already under /usr."""
    dirs = {Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent.parent}
    return sorted(d for d in dirs if d.is_dir() and not str(d).startswith("/usr/"))


def _parents(d: Path) -> list[Path]:
    return [p for p in reversed(d.parents) if str(p) != "/"]


@ENV_RUNTIMES.register("bwrap")
class BwrapRuntime(HostRuntime):
    name = "bwrap"
    remaps_paths = True

    def __init__(self, cfg: EnvsConfig | None = None) -> None:
        super().__init__(cfg)
        self.reaper = reaper_path(self.root)  # None without a C compiler (logged)
        self.bwrap = check_bwrap(self.cfg.bwrap_path, self.reaper)
        self.drop_uid = self.is_root
        self.etc = build_etc(self.root, self.cfg)
        if self.cfg.seccomp:
            seccomp_program()  # built once per process; a missing libseccomp fails here, saying how to fix it
        self.proc_args = []
        for name in _PROC_READ_ONLY + (() if self.is_root else _PROC_READ_ONLY_USER):
            if os.path.exists(f"/proc/{name}"):
                self.proc_args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
        for name in _PROC_MASKED:
            if os.path.exists(f"/proc/{name}"):
                self.proc_args += ["--ro-bind", str(self.etc / "empty"), f"/proc/{name}"]
        # a config file's relative paths were made absolute from its folder when it loaded (config_paths.py);
        # --set ones from the working directory; what is still relative (a Config built in code) is the cwd's
        self.ro_binds = [str(Path(p).resolve()) for p in self.cfg.ro_binds]
        for p in self.ro_binds:
            if not Path(p).exists():
                warnings.warn(f"rollout.envs.ro_binds: {p} does not exist on this host; it is left out of the sandbox")
        ws_path = Path(self.cfg.workspace_path)
        for p in ([str(d) for d in _python_dirs()] if self.cfg.bind_python else []) + self.ro_binds:
            if Path(p) == ws_path or ws_path in Path(p).parents:
                raise EnvError(f"the workspace's path in the sandbox, {ws_path}, would hide {p} (bound read-only for "
                               "commands to use): choose another rollout.envs.workspace_path (or Harbor WORKDIR)")

    def sandbox_argv(self, ws: Workspace, argv: list[str], *, unix_sockets: list[Path]) -> list[str]:
        """The bwrap command line running ``argv`` in ``ws`` (public for tests and docs)."""
        cfg = self.cfg
        a = [self.bwrap, "--unsetenv", "POSIXLY_CORRECT", "--die-with-parent", "--new-session",
             "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--hostname", "sandbox"]  # fmt: skip
        # not --unshare-all as root: its user namespace would map uid 0 to 0 only, leaving no unprivileged
        # uid for setpriv to switch to (and RLIMIT_NPROC never binds root)
        if not self.is_root:
            a += ["--unshare-user", "--disable-userns"]
        a += ["--ro-bind", "/usr", "/usr", *_system_links(), "--ro-bind", str(self.etc), "/etc"]
        # /tmp first: a bind below it (a socket, a ro_binds path) must land on the tmpfs, not under it
        a += ["--proc", "/proc", *self.proc_args, "--dev", "/dev", "--perms", "1777",
              "--size", str(cfg.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]  # fmt: skip
        binds = [str(d) for d in _python_dirs()] if cfg.bind_python else []
        binds += [p for p in self.ro_binds if Path(p).exists()]
        for p in binds:
            a += ["--ro-bind", p, p]
        a += ["--bind", str(ws.path), cfg.workspace_path]
        extra_mounts = dict(ws.extra.get("mounts") or {})  # evaluate's: a directory of the copy shown elsewhere
        for target, rel in extra_mounts.items():
            a += ["--bind", str(ws.path / rel), target]
        for s in unix_sockets:
            a += ["--bind", str(s), str(s)]
        # bwrap gives the directories it makes on the way to a mount point the host's modes (/root: 0700);
        # open those that are not themselves mounts, so the sandbox uid can reach what is bound
        mounts = {"/usr", "/etc", "/proc", "/dev", cfg.workspace_path, *binds, *map(str, unix_sockets), *extra_mounts}
        made = {str(p) for m in [*binds, *map(str, unix_sockets), cfg.workspace_path, *extra_mounts]
                for p in _parents(Path(m))}
        for p in sorted(made):  # never /tmp itself: it stays the world-writable tmpfs (1777) with binds below it
            if p != "/tmp" and not any(p == m or p.startswith(m.rstrip("/") + "/") for m in mounts):
                a += ["--chmod", "0755", p]
        a += ["--remount-ro", "/", "--chdir", cfg.workspace_path]
        uid = ws.extra.get("uid")
        if isinstance(uid, int):
            a += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        # a fresh anonymous session keyring first: the job's own (systemd, pam_keyinit, a pod's) is never inherited
        a += ["--", KEYCTL, "session", "-"]
        if isinstance(uid, int):
            a += ["/usr/bin/setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--inh-caps=-all",
                  "--bounding-set=-all", "--no-new-privs"]  # fmt: skip
        # RLIMIT_NPROC set here, inside, not on bwrap: as another user, the limit bwrap holds when it makes
        # the user namespace becomes that namespace's cap on the whole uid (the trainer's own threads, every
        # other sandbox, zombies the host has not reaped yet), while one set inside counts only this
        # namespace's processes. As root it binds the workspace's uid alike.
        return a + ["/usr/bin/prlimit", f"--nproc={self.limits.processes}:{self.limits.processes}", "--", *argv]

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        path = "/usr/local/bin:/usr/bin:/bin"
        if self.cfg.bind_python:
            path = f"{Path(sys.executable).parent}:{path}"
        out = {"PATH": path, "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
        out.update(env or {})
        out["POSIXLY_CORRECT"] = "1"  # for prlimit's option parsing only; bwrap unsets it in the sandbox
        return out

    async def _exec(self, ws, argv, *, timeout_s, env, stdin, unix_sockets) -> CommandResult:  # noqa: ANN001
        for s in unix_sockets:
            if self.drop_uid and not os.stat(s).st_mode & 0o002:
                raise EnvError(
                    f"unix socket {s} is not writable by others, so the sandbox's unprivileged uid cannot connect "
                    "to it: chmod it 0o666 (only sandboxes it is bound into and this host's users can reach it)"
                )
        status_r = status_w = filter_fd = None
        try:
            status_r, status_w = os.pipe()  # bwrap writes {"exit-code": N} there only if the sandbox started
            filter_fd = seccomp_fd() if self.cfg.seccomp else None
            sandbox = self.sandbox_argv(ws, argv, unix_sockets=unix_sockets)
            sandbox[1:1] = ["--json-status-fd", str(status_w)]
            if filter_fd is not None:
                sandbox[1:1] = ["--seccomp", str(filter_fd)]
            res = await run_process(
                ([self.reaper] if self.reaper else []) + rlimit_prefix(self.limits) + sandbox,
                cwd=ws.path,
                env=self._env(env),
                stdin=stdin,
                wall_s=timeout_s if timeout_s is not None else self.limits.wall_s,
                output_bytes=self.cfg.output_kb * 1024,
                shown_argv=argv,
                pass_fds=(status_w,) if filter_fd is None else (status_w, filter_fd),
                # the reaper, on SIGTERM, kills bwrap and reaps the sandbox's init before it exits
                kill_signal=signal.SIGTERM if self.reaper else signal.SIGKILL,
            )
            os.set_blocking(status_r, False)
            try:
                status = os.read(status_r, 65536).decode("utf-8", "replace")
            except BlockingIOError:
                status = ""
        except OSError as e:
            if is_transient(e):
                raise ResourceBusy(f"cannot set up a sandbox now: {e}") from e
            raise
        finally:
            for fd in (status_r, status_w, filter_fd):
                if fd is None:
                    continue
                try:
                    os.close(fd)
                except OSError:
                    pass
        if res.killed is None and '"exit-code"' not in status:
            said = res.stderr.strip()[-2000:]
            if any(t in said for t in _TRANSIENT_TEXTS):
                raise ResourceBusy(f"the sandbox did not start for want of processes, descriptors or memory: {said}")
            raise InfraError(f"the sandbox did not start (exit {res.returncode}): {said}")
        res.stderr = _JOINED.sub("", res.stderr, count=1)
        if res.returncode == 1 and (res.stderr.startswith("bwrap: execvp")
                                    or res.stderr == f"{argv[0]}: No such file or directory\n"):
            res.returncode = 127  # bwrap (or keyctl, as another user) could not find the program: as a shell says it
        if res.killed is None and self._over_disk(ws):
            res.killed = "disk_limit"
        return res
