"""A supervised inference-server subprocess: started in its own process group, healthy once its
``/health`` answers 200, restarted when it dies (up to ``max_restarts`` times), stopped with its
children. The server's output goes to a log file whose tail is quoted when it fails."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from arborl.engine.backends.base import BackendError, ServerUnavailableError
from arborl.engine.backends.orphan_shm import remove_orphans, shm_names

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """In the child: SIGTERM it when the thread that started it dies (a killed arborl leaves no server
    behind; the server stops its own engine processes on SIGTERM). Linux only; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """``argv()`` is called at every (re)start, so a restart serves what the caller names then (the
    latest weights). ``on_restart`` runs after a restart is healthy again."""

    def __init__(self, name: str, argv: Callable[[], list[str]], *, env: dict[str, str], url: str, log_path: Path,
                 startup_timeout_s: float, max_restarts: int, on_restart: Callable[[], None] | None = None) -> None:
        self.name = name
        self._argv = argv
        self.env = env
        self.url = url
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self.restarts = 0
        self.startup_s: list[float] = []  # seconds of every start, the first one included
        self.failure: str | None = None  # set when it died and will not be restarted
        self._proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._shm_before: set[str] = set()  # /dev/shm's multiprocessing files before the current server started

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the server and wait until it is healthy; raises BackendError with its log's tail."""
        atexit.register(self.stop)  # a server never outlives the process that started it
        try:
            self._launch()
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name=f"arborl-{self.name}-watch", daemon=True)
        self._watcher.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def check(self) -> bool:
        """Whether the process is alive; a dead one is marked not ready at once (the watcher restarts it)."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            self._ready.clear()
            return False
        return True

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the server serves; raises ServerUnavailableError when it is gone for good or
        ``timeout`` passes."""
        self.check()
        deadline = time.monotonic() + (self.startup_timeout_s if timeout is None else timeout)
        while not self._ready.wait(0.2):
            if self.failure is not None or self._stopping:
                raise ServerUnavailableError(f"{self.name} server is down: {self.failure or 'shut down'}")
            if time.monotonic() > deadline:
                raise ServerUnavailableError(f"{self.name} server did not come back within {self.startup_timeout_s:.0f} s")

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stopping = True
        self._ready.clear()
        with self._lock:
            self._kill()

    # -- internals --------------------------------------------------------------------------------
    def _launch(self) -> None:
        t0 = time.monotonic()
        with self._lock:
            if self._stopping:
                raise ServerUnavailableError(f"{self.name} server is shut down")
            argv = self._argv()
            log.info("starting %s: %s", self.name, " ".join(argv))
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
            self._shm_before = shm_names()
            try:
                self._proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              preexec_fn=_die_with_parent)
            except OSError as e:
                raise BackendError(f"cannot start the {self.name} server ({argv[0]}): {e}") from e
            finally:
                out.close()
            proc = self._proc
        while True:
            if proc.poll() is not None:
                raise BackendError(f"the {self.name} server exited with code {proc.returncode} while starting; "
                                   f"the end of its log ({self.log_path}):\n{log_tail(self.log_path)}")
            if self._healthy():
                break
            if time.monotonic() - t0 > self.startup_timeout_s:
                with self._lock:
                    self._kill()
                raise BackendError(f"the {self.name} server did not answer {self.url}/health within "
                                   f"{self.startup_timeout_s:.0f} s; the end of its log ({self.log_path}):\n"
                                   f"{log_tail(self.log_path)}")
            time.sleep(1.0)
        self.startup_s.append(time.monotonic() - t0)
        self._ready.set()

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _watch(self) -> None:
        while not self._stopping:
            proc = self._proc
            if proc is not None and proc.poll() is not None and not self._stopping:
                self._ready.clear()
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # what the dead server left running in its group
                self._remove_shm(proc.pid)
                if self.restarts >= self.max_restarts:
                    self.failure = (f"it died (exit code {proc.returncode}) and was restarted {self.restarts} times "
                                    f"already (max_restarts); its log: {self.log_path}")
                    log.error("%s server: %s", self.name, self.failure)
                    return
                self.restarts += 1
                log.warning("%s server died (exit code %s); restart %d", self.name, proc.returncode, self.restarts)
                try:
                    self._launch()
                    if self.on_restart is not None:
                        self.on_restart()
                except Exception as e:  # noqa: BLE001 - the next loop decides whether to try again
                    log.error("restarting the %s server failed: %s", self.name, e)
                    if self._proc is not None and self._proc.poll() is None:
                        with self._lock:
                            self._kill()
                continue
            time.sleep(0.5)

    def _kill(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the server and its engine/worker children
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # children the server left behind
        self._remove_shm(proc.pid)

    def _remove_shm(self, pgid: int) -> None:
        """Unlink the shared memory the server's dead group left in /dev/shm (``orphan_shm``)."""
        removed = remove_orphans(pgid, self._shm_before)
        if removed:
            log.info("%s server: removed %d shared-memory files its processes left in /dev/shm: %s",
                     self.name, len(removed), ", ".join(removed))
