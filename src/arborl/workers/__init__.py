"""Rollout workers (A4): episodes (agent + environment) run in worker processes that reach the
gateway over HTTP, so a hanging or crashing agent or sandbox never blocks the controller or another
episode. ``WorkerPool`` (the controller's side) starts and supervises them; ``main`` is a worker."""

from arborl.workers.pool import RemoteAgent, WorkerDiedError, WorkerPool

__all__ = ["RemoteAgent", "WorkerDiedError", "WorkerPool"]
