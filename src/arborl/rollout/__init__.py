"""Rollout scheduling policies only: consumption (sync, async ratio, windowed FIFO, version filter),
dispatch (pinned, Seer), partial-rollout arithmetic and the rollout timeline. The engine pool, the
controller and the simulator drive these same classes."""
