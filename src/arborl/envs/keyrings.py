"""Linux kernel keyrings, which neither bubblewrap nor ``setpriv`` isolates.

A process's session keyring is inherited across fork and exec, and a uid's user keyrings (``@u``, ``@us``)
and persistent keyring live in the kernel for as long as the machine runs, whoever holds the uid. So a
sandbox shares the job's session keyring (read its keys, plant new ones for the next episode) and, as root,
a pooled uid's user keyrings carry whatever one episode left there into the next episode that draws the
uid. The sandbox closes both: every command joins a fresh anonymous session keyring (``bwrap.py``), the
syscall filter refuses the keyring calls (``seccomp.py``), and the uid pool clears a uid's keyrings when it
hands the uid out and when it takes it back (:func:`clear_user_keyrings`, defence in depth where the filter
is off).

The calls are the raw system calls (``add_key``, ``keyctl``) through ctypes; no library is needed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

SYS_ADD_KEY, SYS_KEYCTL, SYS_SETRESUID, SYS_SETRESGID = 248, 250, 117, 119  # x86_64
KEY_SPEC_THREAD_KEYRING, KEY_SPEC_SESSION_KEYRING = -1, -3
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEYCTL_UNLINK, KEYCTL_SEARCH, KEYCTL_READ = 1, 7, 9, 10, 11
KEYCTL_INVALIDATE, KEYCTL_GET_PERSISTENT = 21, 22


class KeyringError(OSError):
    pass


def keyctl(op: int, *args: int | bytes | None) -> int:
    """``keyctl(op, args...)``; raises KeyringError with the errno on failure."""
    cargs = [ctypes.c_long(a) if isinstance(a, int) else ctypes.c_char_p(a) for a in args]
    r = _libc.syscall(ctypes.c_long(SYS_KEYCTL), ctypes.c_long(op), *cargs)
    if r < 0:
        e = ctypes.get_errno()
        raise KeyringError(e, f"keyctl({op}): {os.strerror(e)}")
    return int(r)


def add_key(key_type: bytes, description: bytes, payload: bytes, keyring: int) -> int:
    r = _libc.syscall(ctypes.c_long(SYS_ADD_KEY), ctypes.c_char_p(key_type), ctypes.c_char_p(description),
                      ctypes.c_char_p(payload), ctypes.c_size_t(len(payload)), ctypes.c_long(keyring))
    if r < 0:
        e = ctypes.get_errno()
        raise KeyringError(e, f"add_key: {os.strerror(e)}")
    return int(r)


def join_new_session_keyring(name: bytes | None = None) -> int:
    """This thread joins a new session keyring (anonymous unless ``name``); returns its serial."""
    return keyctl(KEYCTL_JOIN_SESSION_KEYRING, name)


def clear_user_keyrings(uid: int) -> None:
    """Empty ``uid``'s user keyring, user session keyring and persistent keyring (as root).

    A key's permissions are checked against the caller's fsuid, and root has no override for another
    uid's keyrings, so the work runs as ``uid``: in a new thread that switches only its own credentials
    (the raw ``setresuid`` system call, not libc's, which would switch every thread) and ends, so no thread
    of this process is ever left with them. The thread first joins a fresh session keyring so that
    nothing it does touches this process's own. No-op for keyrings that do not exist."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for call in ((SYS_SETRESGID, uid, uid, uid), (SYS_SETRESUID, uid, uid, uid)):
                if _libc.syscall(*map(ctypes.c_long, call)) != 0:
                    raise KeyringError(ctypes.get_errno(), f"cannot switch a thread to uid {uid}")
            join_new_session_keyring()
            for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
                keyctl(KEYCTL_CLEAR, ring)
            try:
                persistent = keyctl(KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING)
            except KeyringError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.ENOTSUP):
                    raise
            else:
                keyctl(KEYCTL_CLEAR, persistent)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)

    t = threading.Thread(target=work, name=f"arborl-clear-keyrings-{uid}", daemon=True)
    t.start()
    t.join()
    if errors:
        e = errors[0]
        if isinstance(e, KeyringError) and e.errno == errno.ENOSYS:  # a kernel without keyrings: nothing to clear
            return
        raise e
