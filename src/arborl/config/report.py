"""What a run reports besides its run directory (report/)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from arborl.config.base import Section, comma_list


class ReportConfig(Section):
    """What a run reports besides its run directory's files: metrics loggers (report/loggers.py)."""

    loggers: list[str] = Field(
        default_factory=lambda: ["jsonl"],
        description="where each step's metrics go (registry report.loggers.LOGGERS): jsonl (metrics.jsonl, always "
        "written), tensorboard (<run_dir>/tensorboard), wandb (offline, <run_dir>/wandb), mlflow (local file store "
        "<run_dir>/mlruns), or module:attr / file.py:attr; the trackers are extras: pip install 'arborl[tensorboard]'",
    )
    curves: bool = Field(
        True,
        description="draw <run_dir>/curves.png (each step's reward, success, loss, ...) when the run ends; about a "
        "second of matplotlib per run, so off for sweeps of many short runs (metrics.jsonl holds the same numbers)",
    )

    @field_validator("loggers", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return comma_list(value)  # --set report.loggers=jsonl,tensorboard
