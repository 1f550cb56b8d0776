"""Workspace directories on the host: a fresh copy of a template (E1), a size cap, and removal.

A copy, never hard links: a hard-linked file is the template's own inode, so an agent writing it would
change the template for every later episode. Symbolic links are copied as links and never followed, so
a link an agent planted (``leak -> /root/.ssh/id_rsa``) copies as a dangling link, not the file. FIFOs,
sockets and devices are skipped. As root a workspace is its own size-capped tmpfs (``disk_mb``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
from pathlib import Path

from arborl.envs.base import TRANSIENT_ERRNOS, EnvError, InfraError, ResourceBusy

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def check_template(template: Path) -> Path:
    """The template as an absolute directory path, or an EnvError naming what is wrong."""
    template = Path(template).expanduser()
    if not template.exists():
        raise EnvError(f"template directory {template} does not exist")
    if not template.is_dir():
        raise EnvError(f"template {template} is not a directory (give the task's repository directory)")
    return template.resolve()


def mount_tmpfs(path: Path, *, size_mb: int, uid: int | None) -> None:
    """Mount a tmpfs of ``size_mb`` MiB (and a bounded inode count) at ``path``, owned by ``uid``."""
    opts = f"size={size_mb}m,nr_inodes={max(1024, size_mb * 64)},mode=0700"
    if uid is not None:
        opts += f",uid={uid},gid={uid}"
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise (ResourceBusy if err in TRANSIENT_ERRNOS else InfraError)(f"cannot mount a tmpfs at {path}: {os.strerror(err)}")


def unmount(path: Path) -> None:
    if _libc.umount2(str(path).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2) and not (err == 1 and os.geteuid() != 0):  # EINVAL: not a mount point; ENOENT: gone;
            # EPERM as another user than root: it never mounts workspaces, so none is its own to unmount
            raise InfraError(f"cannot unmount {path}: {os.strerror(err)}")


def copy_tree(src: Path, dst: Path, *, uid: int | None) -> int:
    """Copy ``src``'s contents into the existing directory ``dst`` (links as links; special files
    skipped); files are owned by ``uid`` when given. Returns the number of entries copied."""
    n = 0
    for root, dirs, files in os.walk(src, followlinks=False):
        rel = os.path.relpath(root, src)
        out = dst if rel == "." else dst / rel
        for d in list(dirs):
            s, t = os.path.join(root, d), out / d
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):  # os.walk lists links to dirs as dirs
                _clear(t)
                os.symlink(os.readlink(s), t)
                dirs.remove(d)
            elif t.is_dir() and not t.is_symlink():
                continue  # a directory already made
            else:
                _clear(t)
                os.mkdir(t, stat.S_IMODE(st.st_mode) | 0o700)
            _own(t, uid)
            n += 1
        for f in files:
            s, t = os.path.join(root, f), out / f
            st = os.lstat(s)
            _clear(t)  # never write through what is there: it may be the agent's link to a host file
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(s, t, follow_symlinks=False)
                os.chmod(t, stat.S_IMODE(st.st_mode) | 0o600)
                os.utime(t, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                continue
            _own(t, uid)
            n += 1
    return n


def copy_with_cp(src: Path, dst: Path, *, uid: int | None) -> None:
    """``cp -a --reflink=auto`` of ``src``'s contents into ``dst``: copy-on-write clones where the
    filesystem supports them (btrfs, XFS), a plain copy elsewhere; never follows links."""
    r = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--no-dereference", "--no-preserve=ownership", f"{src}/.", str(dst)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise InfraError(f"cp of {src} into {dst} failed: {r.stderr.strip()}")
    if uid is not None:
        for root, dirs, files in os.walk(dst):
            for name in dirs + files:
                _own(Path(root) / name, uid)


def _clear(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        remove_tree(path)


def remove_bytecode(path: Path) -> None:
    """Delete ``__pycache__`` directories: bytecode an agent planted must not stand in for a test file."""
    for root, dirs, _ in os.walk(path):
        for d in [d for d in dirs if d == "__pycache__"]:
            remove_tree(Path(root) / d)
            dirs.remove(d)


def _own(path: Path | str, uid: int | None) -> None:
    if uid is not None:
        os.lchown(path, uid, uid)


def tree_bytes(path: Path) -> int:
    """Bytes held by the files under ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def remove_tree(path: Path) -> None:
    """Delete ``path`` even where an agent took away permissions (chmod 000 dirs) as a non-root owner."""

    def fix(func, p, exc):  # noqa: ANN001 - shutil's onerror signature
        if isinstance(exc[1], FileNotFoundError):
            return
        if not isinstance(exc[1], PermissionError):  # EMFILE and the like: chmod would not help
            raise exc[1]
        parent = os.path.dirname(p)
        try:
            os.chmod(parent, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            if func in (os.open, os.scandir, os.listdir):  # a directory it could not enter: start over below it
                shutil.rmtree(p, onerror=fix)
            else:
                func(p)
        except FileNotFoundError:
            pass

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=fix)
