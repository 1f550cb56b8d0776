"""Rollout scheduling policies only: consumption (sync, async ratio, windowed FIFO, dynamic sampling, version
filter), dispatch (pinned, Seer), partial-rollout arithmetic and the rollout timeline. The engine pool, the
controller and the simulator drive these same classes."""

from arborl.scheduling import dynamic  # noqa: F401  (registers the "dynamic" consumption policy)
