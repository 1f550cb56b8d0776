"""The trainer as a Ray actor that survives being killed (``cluster.trainer_restarts > 0``).

The job's driver half -- trainer, controller, gateway and the data pool it owns -- runs in a
``TrainerActor`` with ``cluster.trainer_cpus`` / ``cluster.trainer_gpus``; the engine actors it
places are owned by it, so they go with it. When that actor dies (killed, OOM, its node lost), the
run starts again in a new one from its last checkpoint (``rollout.checkpoint_every``), up to
``cluster.trainer_restarts`` times: the data pool is reopened from its SQLite WAL, the episodes the
dead actor left running are marked aborted (never trained), and the steps after the checkpoint run
again. The ``arborl train`` process only waits. A first SIGINT / SIGTERM there is passed on to the
run in the actor, which stops after the step in flight with a checkpoint (``RunStopped``, exit status
130 / 143, as without Ray); a second one stops the actor at once (the last checkpoint stands). Either
way no Ray process is left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from arborl.cluster.session import ClusterError, on_node, ray_module, remove_orphans, start, stop
from arborl.config import Config
from arborl.train.ranks import RankError
from arborl.types import ArborlError

log = logging.getLogger(__name__)

SUPERVISED_ENV = "ARBORL_TRAINER_ACTOR"  # set inside the actor: train() runs there, not supervised again
POLL_S = 0.2  # how often the waiting driver looks for a signal to pass on

_run_stop: Any = None  # inside the trainer actor: the run's StopRequest (``serve_stop``)


def serve_stop(stop: Any) -> None:
    """Called by the run inside the trainer actor with its ``StopRequest``: the driver's Ctrl-C sets it
    (the actor's thread gets no signals of its own)."""
    global _run_stop
    _run_stop = stop


class TrainerActor:
    """Wrapped with ``ray.remote`` by ``run_supervised``; one attempt of the run."""

    def pid(self) -> int:
        return os.getpid()

    def train(self, train_fn: Callable[..., dict], cfg: dict, resume: bool, overwrite: bool) -> dict:
        os.environ[SUPERVISED_ENV] = "1"
        return train_fn(Config.model_validate(cfg), resume=resume, overwrite=overwrite)

    def request_stop(self, signum: int) -> bool:
        """Stop the run after its step in flight, as that signal would; False while it has not started yet."""
        stop = _run_stop
        if stop is None:
            return False
        if not stop.requested:
            stop._on_signal(signum)  # what the signal handler does on a main thread
        return True


def actor_name(cfg: Config, attempt: int = 0) -> str:
    """The trainer actor's name (``ray.get_actor``) in the job's namespace: one per attempt (a dead
    actor's name is freed only some time after its death)."""
    return f"arborl-trainer-{cfg.name}-{attempt}"


def supervised() -> bool:
    """True inside the trainer actor (its ``train`` must not supervise itself again)."""
    return os.environ.get(SUPERVISED_ENV) == "1"


class Supervisor:
    """Runs ``train_fn`` in a trainer actor and restarts it from the last checkpoint when it dies.
    ``pids`` lists the actors' processes (the last one is running), ``restarts`` the times it resumed."""

    def __init__(self, cfg: Config, train_fn: Callable[..., dict], has_checkpoint: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.train_fn = train_fn
        self.has_checkpoint = has_checkpoint
        self.pids: list[int] = []
        self.restarts = 0
        self.actor = None
        self.signum: int | None = None  # the first SIGINT / SIGTERM the driver got

    def _wait(self, ref: Any) -> Any:
        """The run's result; a signal meanwhile is passed on to the run (``request_stop``)."""
        ray = ray_module()
        passed = False
        with self._signals():
            while not ray.wait([ref], timeout=POLL_S)[0]:
                if self.signum is not None and not passed:
                    passed = ray.get(self.actor.request_stop.remote(self.signum))
            return ray.get(ref)

    @contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGINT / SIGTERM while the run is in the actor: the first is noted (``_wait`` passes it on), a
        second stops at once (KeyboardInterrupt; the caller's ``finally`` kills the actor). Only on the
        main thread (a run in a thread leaves the process's handlers alone)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: Any) -> None:
            if self.signum is None:
                self.signum = signum
                log.warning("%s received: the trainer actor stops after the step in flight, with a checkpoint "
                            "(send it again to stop at once)", signal.Signals(signum).name)
            else:
                raise KeyboardInterrupt

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
        c = self.cfg.cluster
        started = start(c)
        ray = ray_module()
        cfg_json = self.cfg.model_dump(mode="json")
        try:
            while True:
                self.actor = ray.remote(TrainerActor).options(
                    name=actor_name(self.cfg, self.restarts), num_cpus=c.trainer_cpus, num_gpus=c.trainer_gpus,
                    resources=on_node(c.trainer_node), max_restarts=0,
                    max_concurrency=2).remote()  # ``pid`` answers while ``train`` runs
                try:
                    self.pids.append(ray.get(self.actor.pid.remote(), timeout=c.placement_timeout_s))
                except ray.exceptions.GetTimeoutError:
                    raise ClusterError(
                        f"the trainer actor (cluster.trainer_cpus={c.trainer_cpus:g}, cluster.trainer_gpus="
                        f"{c.trainer_gpus:g}) was not placed within cluster.placement_timeout_s="
                        f"{c.placement_timeout_s:g} s; the cluster has {ray.available_resources()} free") from None
                try:
                    return self._wait(self.actor.train.remote(self.train_fn, cfg_json, resume, overwrite))
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                    # the run's own error (IdleRunError, ...): as raised there; a trainer rank that died
                    # (train.parallel, RankError: the ranks are gone) is the trainer's death
                    rank_died = isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, RankError)
                    if isinstance(e, ray.exceptions.RayTaskError) and not rank_died:
                        if isinstance(e.cause, ArborlError):
                            raise e.cause from None
                        raise
                    if rank_died:
                        ray.kill(self.actor, no_restart=True)
                    if self.signum is not None:
                        raise ClusterError(f"the trainer actor died while stopping on {signal.Signals(self.signum).name} "
                                           f"({e}); resume from the last checkpoint") from e
                    if self.restarts >= c.trainer_restarts:
                        raise ClusterError(f"the trainer actor died {self.restarts + 1} times "
                                           f"(cluster.trainer_restarts={c.trainer_restarts}); last: {e}") from e
                    self.restarts += 1
                    remove_orphans(self.pids[-1])  # its engines' and workers' placement groups outlive it
                    resume = self.has_checkpoint()
                    overwrite = not resume  # died before its first checkpoint: start over
                    log.warning("the trainer actor died (%s); %s (restart %d of %d)", type(e).__name__,
                                "resuming from the last checkpoint" if resume else "starting over (no checkpoint yet)",
                                self.restarts, c.trainer_restarts)
        finally:
            if self.actor is not None:
                try:
                    ray.kill(self.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            stop(started)
