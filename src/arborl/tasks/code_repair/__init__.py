"""Code repair (issue 13): small Python repositories with one injected bug each, hidden pytest tests,
a gold patch and a problem statement, in three tiers; validation (E3) and perturbed variants (E5).

* ``templates.py``: the bug templates; ``generate.py``: templates -> task files (seeded);
* ``store.py``: a task on disk and reading it back; ``catalog.py``: the suite materialised in a cache;
* ``scoring.py``: hidden tests against a workspace -> per-test verdict;
* ``validate.py``: gold passes, no-op fails, k runs agree; cached per task hash;
* ``perturb.py``: variants; ``suite.py``: the registered ``code_repair`` suite.
"""

from __future__ import annotations

from arborl.tasks.code_repair.catalog import default_root, materialise
from arborl.tasks.code_repair.generate import TIERS, GenerationError, TaskFiles, generate, make_task
from arborl.tasks.code_repair.perturb import PERTURBATIONS, variants
from arborl.tasks.code_repair.scoring import Verdict, run_hidden_tests
from arborl.tasks.code_repair.store import RepairTask, TaskFileError, load_task, write_task
from arborl.tasks.code_repair.suite import CodeRepairSuite, RepairEnv, RepairEpisode, WorkspaceAgent, submit_unchanged
from arborl.tasks.code_repair.templates import BUG_TEMPLATES
from arborl.tasks.code_repair.validate import ValidationCache, ValidationReport, validate_task, validate_tasks

__all__ = [
    "BUG_TEMPLATES", "PERTURBATIONS", "TIERS", "CodeRepairSuite", "GenerationError", "RepairEnv", "RepairEpisode",
    "RepairTask", "TaskFileError", "TaskFiles", "ValidationCache", "ValidationReport", "Verdict", "WorkspaceAgent",
    "default_root", "generate", "load_task", "make_task", "materialise", "run_hidden_tests", "submit_unchanged",
    "validate_task", "validate_tasks", "variants", "write_task",
]  # fmt: skip
