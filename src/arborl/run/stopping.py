"""Stopping a training run on SIGINT (Ctrl-C) or SIGTERM (kill, Slurm's preemption): the first signal
asks the step loop to stop once the step in flight has finished, so it can save a checkpoint and the
summary; a second signal stops at once without saving (the previous checkpoint stays intact)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable

from arborl.types import ArborlError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(ArborlError):
    """The run stopped on a signal after saving; ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopRequest:
    """Set by the first SIGINT / SIGTERM while installed on an event loop."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notify: Callable[[str], None] = lambda name: None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def install(self, loop: asyncio.AbstractEventLoop, notify: Callable[[str], None]) -> None:
        """Handle both signals on ``loop``; ``notify(signal name)`` runs when the first one arrives."""
        self._notify = notify
        try:
            for sig in SIGNALS:
                loop.add_signal_handler(sig, self._on_signal, sig)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals here
            for sig in SIGNALS:
                with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                    loop.remove_signal_handler(sig)
            return
        self._loop = loop

    def uninstall(self) -> None:
        if self._loop is not None:
            for sig in SIGNALS:
                self._loop.remove_signal_handler(sig)
            self._loop = None

    def _on_signal(self, sig: int) -> None:
        if self.signum is None:
            self.signum = sig
            self._notify(signal.Signals(sig).name)
        else:  # the second one: the default action now (SIGINT raises KeyboardInterrupt, SIGTERM ends the process)
            self.uninstall()
            os.kill(os.getpid(), sig)
