"""Metrics of a run: one JSON object per line (appended and flushed, so a crash keeps every
finished step), and a rich summary table (the curves are in curves.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table


class MetricsLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (a resumed run redoes them)."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))


def summary_table(summary: dict[str, Any], title: str = "run summary") -> Table:
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    return table
