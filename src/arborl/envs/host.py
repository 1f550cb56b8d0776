"""What both runtimes share: workspaces on the host (prepare, evaluate's scratch copy, close).

A runtime subclass says how one command runs (``_exec``); this class makes and removes the
directories, holds a workspace's sandbox uid, and runs ``evaluate`` in a separate scratch workspace.
Every step that takes from the host (a workspace and its uid, a command's start, a close) goes through
the runtime's queue (``envs/queue.py``): short of uids, processes, descriptors or memory it waits.
The seconds waited are ``ws.extra["queue_wait_s"]`` (prepare), ``CommandResult.queued_s`` and
``runtime.queue.stats()``.
"""

from __future__ import annotations

import abc
import asyncio
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from arborl.config import EnvsConfig
from arborl.envs.base import CommandResult, EnvError, InfraError, Limits, ResourceBusy, Workspace, is_transient
from arborl.envs.proc import check_argv, raise_open_files_limit
from arborl.envs.queue import SandboxQueue
from arborl.envs.uids import UidPool
from arborl.envs.workspace import (
    check_template,
    copy_tree,
    copy_with_cp,
    mount_tmpfs,
    remove_bytecode,
    remove_tree,
    tree_bytes,
    unmount,
)

_EPISODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def limits_of(cfg: EnvsConfig) -> Limits:
    return Limits(
        wall_s=cfg.wall_s,
        cpu_s=cfg.cpu_s,
        memory_mb=cfg.memory_mb,
        processes=cfg.processes,
        file_size_mb=cfg.file_size_mb,
        disk_mb=cfg.disk_mb,
    )


def own_root(configured: str) -> Path:
    """``rollout.envs.root_dir``, made if missing (0711) and resolved; an EnvError where it, or a link
    at its name, belongs to another user or others can write to it. Its default sits in /tmp, where
    any local user could make it first and then plant what this job runs or binds into sandboxes
    (the reaper runs as this job's user, as root where the job is root)."""
    path = Path(configured).expanduser()
    me = os.geteuid()
    fix = "remove it, or set rollout.envs.root_dir to a directory only this user can write"
    if path.is_symlink() and os.lstat(path).st_uid != me:
        raise EnvError(f"rollout.envs.root_dir {path} is a link made by uid {os.lstat(path).st_uid}: {fix}")
    path.mkdir(parents=True, exist_ok=True, mode=0o711)
    root = path.resolve()
    st = os.stat(root)
    if st.st_uid != me:
        raise EnvError(f"rollout.envs.root_dir {root} belongs to uid {st.st_uid}, not this user ({me}): {fix}")
    if st.st_mode & 0o022:
        raise EnvError(f"rollout.envs.root_dir {root} can be written by others (mode {st.st_mode & 0o777:o}): {fix}")
    return root


def check_mounts(mounts: Mapping[str, str], supported: bool, runtime: str) -> dict[str, str]:
    """``evaluate``'s mounts, checked: absolute sandbox paths outside the system directories, each
    naming a relative directory of the scratch copy that stays inside it."""
    if mounts and not supported:
        raise EnvError(f"the {runtime} runtime runs commands on the host's own paths and cannot show a directory at "
                       f"{', '.join(mounts)}: use rollout.envs.runtime=bwrap")
    out = {}
    for target, rel in mounts.items():
        t = Path(target)
        if not t.is_absolute() or ".." in t.parts or str(t) == "/" or t.parts[1] in _SYSTEM_TOP:
            raise EnvError(f"mount point {target!r} must be an absolute path outside {', '.join(sorted(_SYSTEM_TOP))}")
        r = Path(rel)
        if r.is_absolute() or ".." in r.parts or str(r) in ("", "."):
            raise EnvError(f"mount source {rel!r} must be a directory inside the workspace copy (a relative path)")
        out[str(t)] = str(r)
    return out


_SYSTEM_TOP = frozenset({"usr", "etc", "proc", "dev", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "tmp", "sys"})


class HostRuntime(abc.ABC):
    """Workspaces under ``cfg.root_dir``; subclasses implement ``_exec``."""

    name = "host"
    drop_uid = False  # run commands as a pooled unprivileged uid (bwrap as root)
    remaps_paths = False  # can show a directory at another path in the sandbox (evaluate's mounts)

    def __init__(self, cfg: EnvsConfig | None = None) -> None:
        self.cfg = cfg or EnvsConfig()
        self.limits = limits_of(self.cfg)
        self.root = own_root(self.cfg.root_dir)
        self.is_root = os.geteuid() == 0
        self.uids = UidPool(self.cfg.sandbox_uid_base, self.cfg.sandbox_uids)
        self.queue = SandboxQueue(self.cfg.sandbox_wait_s)
        raise_open_files_limit()
        self._live: dict[str, Workspace] = {}
        self._pending: set[str] = set()  # ids being prepared

    # -- the protocol -------------------------------------------------------------------------------

    async def prepare(self, template: Path, *, episode_id: str) -> Workspace:
        template = check_template(template)
        if not _EPISODE_ID.match(episode_id):
            raise EnvError(
                f"episode id {episode_id!r} cannot name a directory: use letters, digits, '.', '_' or '-' "
                "(at most 128, not starting with '.' or '-')"
            )
        if episode_id in self._live or episode_id in self._pending:
            raise EnvError(f"episode {episode_id!r} already has a live workspace: close it first or use a new id")
        self._pending.add(episode_id)
        try:
            ws, waited = await self.queue.take(
                lambda: asyncio.to_thread(self._make, template, [], episode_id), f"workspace {episode_id!r}"
            )
        finally:
            self._pending.discard(episode_id)
        ws.extra["queue_wait_s"] = waited
        return ws

    async def run(
        self,
        ws: Workspace,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        unix_sockets: Sequence[Path] = (),
    ) -> CommandResult:
        self._check_live(ws)
        argv = check_argv(argv)
        socks = [Path(s) for s in unix_sockets]
        for s in socks:
            if not s.is_absolute() or not s.exists():
                raise EnvError(f"unix socket {s} does not exist (give the absolute path of a listening socket)")
        return await self._start(ws, argv, timeout_s=timeout_s, env=env, stdin=stdin, unix_sockets=socks)

    async def evaluate(
        self,
        ws: Workspace,
        tests: Path,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        mounts: Mapping[str, str] | None = None,
    ) -> CommandResult:
        self._check_live(ws)
        argv = check_argv(argv)
        mounts = check_mounts(mounts or {}, self.remaps_paths, self.name)
        tests = Path(tests).expanduser()
        if not tests.is_dir():
            raise EnvError(f"hidden tests directory {tests} does not exist or is not a directory")
        scratch_id = f"{ws.episode_id}.eval-{secrets.token_hex(4)}"
        # room for a full workspace, the tests and what the test run writes: an agent that filled its
        # workspace must not make its own evaluation fail to start
        size_mb = self.cfg.disk_mb + (tree_bytes(tests) >> 20) + 1 + self.cfg.disk_mb // 4 + 16
        scratch, waited = await self.queue.take(
            lambda: asyncio.to_thread(self._make, ws.path, [(tests.resolve(), tests.name)], scratch_id, size_mb),
            f"evaluation workspace {scratch_id!r}",
        )
        try:
            if mounts:
                await asyncio.to_thread(self._mount_dirs, scratch, mounts)
            res = await self._start(scratch, argv, timeout_s=timeout_s, env=env, stdin=None, unix_sockets=[])
            res.queued_s += waited
            return res
        finally:
            await self._close(scratch)

    async def close(self, ws: Workspace) -> None:
        if self._live.get(ws.episode_id) is ws:
            await self._close(ws)

    # -- helpers ------------------------------------------------------------------------------------

    async def _start(self, ws: Workspace, argv: list[str], **kw) -> CommandResult:  # noqa: ANN003
        """``_exec``, queued while the host has no processes, descriptors or memory to start it."""
        try:
            res, waited = await self.queue.take(lambda: self._exec(ws, argv, **kw), f"command {argv[0]!r}")
        finally:
            self.queue.freed()  # its processes and pipes are gone
        res.queued_s = waited
        return res

    async def _close(self, ws: Workspace) -> None:
        await self.queue.take(lambda: asyncio.to_thread(self._destroy, ws), f"closing workspace {ws.episode_id!r}")

    def _mount_dirs(self, ws: Workspace, mounts: dict[str, str]) -> None:
        """Make the directories ``mounts`` shows elsewhere (owned by the workspace's uid) and note them."""
        uid = ws.extra.get("uid")
        for rel in mounts.values():
            d = ws.path / rel
            if d.is_symlink() or (d.exists() and not d.is_dir()):
                d.unlink()
            for p in [*reversed(d.relative_to(ws.path).parents), d.relative_to(ws.path)]:
                q = ws.path / p
                if str(p) != "." and not q.exists():
                    q.mkdir()
                    if isinstance(uid, int):
                        os.chown(q, uid, uid)
        ws.extra["mounts"] = dict(mounts)

    def _check_live(self, ws: Workspace) -> None:
        if self._live.get(ws.episode_id) is not ws:
            raise EnvError(f"workspace {ws.episode_id!r} is not live in this runtime (closed, or made by another one)")

    def _make(self, source: Path, extra: list[tuple[Path, str]], episode_id: str, size_mb: int | None = None) -> Workspace:
        """A workspace holding a copy of ``source`` (and each ``extra`` directory at its relative name);
        ResourceBusy, with nothing left taken, where the host has no uid, descriptor or memory for it now."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        path = self.root / episode_id
        try:
            if path.exists() or path.is_symlink():  # a crashed process's leftover, or a failed try's: never reuse it
                unmount(path)
                remove_tree(path)
        except OSError as e:
            if is_transient(e):
                raise ResourceBusy(f"cannot remove the leftover {path} now: {e}") from e
            raise
        uid = self.uids.acquire() if self.drop_uid else None
        ws = Workspace(episode_id=episode_id, path=path, template=source, runtime=self.name)
        ws.extra["uid"] = uid
        ws.extra["copy_mode"] = self.cfg.copy_mode
        try:
            path.mkdir(mode=0o700)
            if self.is_root:
                mount_tmpfs(path, size_mb=size_mb or self.cfg.disk_mb, uid=uid)
                ws.extra["disk_cap"] = "tmpfs"
            else:
                ws.extra["disk_cap"] = "check"
            for src, rel in [(source, ".")] + extra:
                dst = path / rel
                if rel != ".":
                    # the hidden tests replace whatever the agent left at their name (a file, a link, a
                    # directory with files of its own): nothing of the agent's is merged into them
                    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
                        dst.unlink()
                    elif dst.exists():
                        remove_tree(dst)
                    dst.mkdir()
                    os.chown(dst, uid, uid) if uid is not None else None
                if self.cfg.copy_mode == "cp" and rel == ".":
                    copy_with_cp(src, dst, uid=uid)
                else:
                    copy_tree(src, dst, uid=uid)
            if extra:
                remove_bytecode(path)
        except OSError as e:
            self._undo(ws)
            if getattr(e, "errno", None) == 28:  # ENOSPC: the template does not fit the disk cap
                raise EnvError(f"{source} does not fit in rollout.envs.disk_mb={self.cfg.disk_mb} MiB: raise it") from e
            if is_transient(e):
                raise ResourceBusy(f"cannot make workspace {path} now: {e}") from e
            raise InfraError(f"cannot make workspace {path} from {source}: {e}") from e
        except BaseException:
            self._undo(ws)
            raise
        self._live[episode_id] = ws
        return ws

    def _undo(self, ws: Workspace) -> None:
        """Remove a workspace that was never handed out. No command ran as its uid, so the uid goes back
        even where the removal fails (the next ``_make`` of its id removes what is left)."""
        try:
            self._destroy(ws, live=False)
        except (OSError, InfraError):
            uid = ws.extra.get("uid")
            if isinstance(uid, int):
                self.uids.release(uid)

    def _destroy(self, ws: Workspace, live: bool = True) -> None:
        """Kill, unmount, delete, give the uid back; each step may be done again (ResourceBusy between)."""
        if live:
            self._live.pop(ws.episode_id, None)
        try:
            self._kill_leftovers(ws)
            unmount(ws.path)
            remove_tree(ws.path)
        except OSError as e:
            if is_transient(e):
                raise ResourceBusy(f"cannot delete workspace {ws.path} now: {e}") from e
            raise
        uid = ws.extra.get("uid")
        if isinstance(uid, int):
            self.uids.release(uid)
        self.queue.freed()

    def _kill_leftovers(self, ws: Workspace) -> None:
        """Kill processes still running as the workspace's uid (none should outlive a command)."""
        uid = ws.extra.get("uid")
        if not isinstance(uid, int):
            return
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if os.stat(f"/proc/{pid}").st_uid == uid:
                        os.kill(int(pid), 9)
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    pass

    def _over_disk(self, ws: Workspace) -> bool:
        """Without a tmpfs cap (not root), whether the workspace now holds more than disk_mb."""
        return ws.extra.get("disk_cap") == "check" and tree_bytes(ws.path) > self.cfg.disk_mb * 1024 * 1024

    @abc.abstractmethod
    async def _exec(
        self,
        ws: Workspace,
        argv: list[str],
        *,
        timeout_s: float | None,
        env: Mapping[str, str] | None,
        stdin: str | None,
        unix_sockets: list[Path],
    ) -> CommandResult:
        """Run ``argv`` in the workspace the way this runtime isolates it."""
