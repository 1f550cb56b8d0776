"""The sandbox's system-call filter (``rollout.envs.seccomp``, on by default).

Every sandboxed command runs under a seccomp filter that bubblewrap loads (``--seccomp FD``) after it has
set the sandbox up and before the command starts. It is modelled on the default profile of Docker /
containerd: every call is allowed except those that reach the kernel's shared state or its attack
surface, which fail with ``EPERM`` (a clean error, never a kill):

* kernel keyrings (``add_key``, ``request_key``, ``keyctl``): a host's session keyring, a uid's ``@u``
  and its persistent keyring are shared across sandboxes; the one ``keyctl`` call left is joining a
  fresh anonymous session keyring, which every command does first (``bwrap.py``),
* other processes' memory and tracing: ``ptrace``, ``process_vm_readv/writev``, ``process_madvise``,
  ``pidfd_getfd``, ``kcmp``,
* kernel attack surface: ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``,
  ``open_by_handle_at`` / ``name_to_handle_at`` (a way round mount namespaces), ``*_module``, ``kexec_*``,
* the mount table: ``mount``, ``umount2``, ``pivot_root`` and the new mount API (``fsopen``, ``fsmount``,
  ``move_mount``, ``open_tree``, ...),
* namespaces: ``setns``; ``unshare`` and ``clone`` with any ``CLONE_NEW*`` flag (a user namespace would
  give root inside it); ``clone3`` answers ``ENOSYS`` as in Docker (its flags are behind a pointer a filter
  cannot read), so libc falls back to ``clone``, whose flags it can,
* the machine: ``reboot``, ``swapon/off``, ``settimeofday`` / ``clock_settime`` / ``clock_adjtime``,
  ``acct``, ``quotactl``, ``syslog``, ``ioperm`` / ``iopl``, ``vhangup``, ``lookup_dcookie``, NUMA policy,
  ``fanotify_init``, and the obsolete ``uselib``, ``ustat``, ``sysfs``, ``_sysctl``, ``nfsservctl``, ...
* ``personality`` other than the default (0) and the query (0xffffffff): no ``ADDR_NO_RANDOMIZE``,
  ``READ_IMPLIES_EXEC``, ``MMAP_PAGE_ZERO``.

Only the native ABI passes: a 32-bit (``int 0x80``) or x32 system call gets ``EPERM``, since the filter
checks numbers of the native table only.

The BPF program is built once per process with libseccomp (``pyseccomp``, ctypes over
``libseccomp.so.2``) and handed to each command as a memfd.
"""

from __future__ import annotations

import errno
import os
from functools import lru_cache

from arborl.envs.base import SandboxUnavailableError

FIX = (
    "the sandbox's syscall filter needs libseccomp and its Python bindings: `apt-get install -y libseccomp2` and "
    "`pip install pyseccomp` (`make venv` does both); or, knowing that sandboxed commands then reach every system "
    "call (kernel keyrings, ptrace, mount, bpf, ...), turn the filter off with --set rollout.envs.seccomp=false"
)

# denied outright (EPERM); names this libseccomp does not know are skipped, those of other ABIs are no-ops
DENIED: tuple[str, ...] = (
    # kernel keyrings (keyctl: see KEYCTL_JOIN_SESSION_KEYRING below)
    "add_key", "request_key",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    # kernel attack surface
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at",
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load",
    # the mount table (bubblewrap mounts before the filter is loaded)
    "mount", "umount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr",
    # namespaces
    "setns",
    # the machine
    "reboot", "swapon", "swapoff", "settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex", "acct",
    "quotactl", "quotactl_fd", "syslog", "ioperm", "iopl", "vhangup", "lookup_dcookie", "fanotify_init",
    "mbind", "set_mempolicy", "get_mempolicy", "migrate_pages", "move_pages", "set_mempolicy_home_node",
    # obsolete
    "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl", "vm86", "vm86old",
)  # fmt: skip

KEYCTL_JOIN_SESSION_KEYRING = 1
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWTIME = 0x10000000, 0x20000000, 0x40000000, 0x00000080
_CLONE_NS = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET)


def _bindings():  # noqa: ANN202 - the pyseccomp module
    try:
        import pyseccomp
    except ImportError as e:  # the package missing, or libseccomp.so.2 (it raises RuntimeError then)
        raise SandboxUnavailableError(f"{e}: {FIX}") from e
    except RuntimeError as e:
        raise SandboxUnavailableError(f"{e}: {FIX}") from e
    return pyseccomp


@lru_cache(maxsize=1)
def program() -> bytes:
    """The filter as a BPF program (``struct sock_filter`` array), built once per process."""
    sc = _bindings()
    eperm = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, eperm)  # another ABI (x32, ia32): refused, not killed
    for name in DENIED:
        if sc.resolve_syscall(sc.Arch.NATIVE, name) != -1:  # -1: a name this libseccomp does not know
            f.add_rule(eperm, name)
    # keyctl: only "join a fresh anonymous session keyring" (keyctl(1, NULL)), which every command does first
    f.add_rule(eperm, "keyctl", sc.Arg(0, sc.NE, KEYCTL_JOIN_SESSION_KEYRING))
    f.add_rule(eperm, "keyctl", sc.Arg(0, sc.EQ, KEYCTL_JOIN_SESSION_KEYRING), sc.Arg(1, sc.NE, 0))
    # no new namespaces (a user namespace makes its creator root inside it): one rule per flag
    for flag in (*_CLONE_NS, CLONE_NEWTIME):
        f.add_rule(eperm, "unshare", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for flag in _CLONE_NS:  # clone's low byte is the exit signal, not CLONE_NEWTIME
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # personality: the kernel reads 32 bits; refuse any value with a set bit whose next bit (cyclically) is
    # clear, which leaves exactly 0 (PER_LINUX) and 0xffffffff (the query)
    for bit in range(32):
        this, following = 1 << bit, 1 << ((bit + 1) % 32)
        f.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, this | following, this))
    fd = os.memfd_create("arborl-seccomp", os.MFD_CLOEXEC)
    try:
        f.export_bpf(_Fd(fd))
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class _Fd:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


def program_fd() -> int:
    """A new file descriptor holding the program, for ``bwrap --seccomp FD`` (bubblewrap reads it to EOF;
    the caller closes it after the command has started)."""
    data = program()
    fd = os.memfd_create("arborl-seccomp")
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
