"""The web dashboard (``arborl dashboard``, and ``/dashboard`` under ``arborl serve``): curves of several
runs, the rollout timeline per step, a token-level trajectory browser over the data pool, the run's
config; and the run listing ``arborl runs`` / ``arborl compare`` print."""

from arborl.dashboard.app import create_app
from arborl.dashboard.runs import Run, RunNotFoundError, find_runs, run_keys

__all__ = ["Run", "RunNotFoundError", "create_app", "find_runs", "run_keys"]
