"""Harbor / terminal-bench task folders as a task suite (``rollout.task=harbor``): ``suite.py``."""

from arborl.tasks.harbor.suite import HarborSuite, Verdict
from arborl.tasks.harbor.task_folder import HarborTask, HarborTaskError, read_task, read_tasks

__all__ = ["HarborSuite", "HarborTask", "HarborTaskError", "Verdict", "read_task", "read_tasks"]
