"""Run outputs: metrics.jsonl, summary.json, plots, the end-of-run table, the lines printed per step."""

from arborl.report.curves import plot_run, run_figure
from arborl.report.lines import idle_reason, idle_warning, plural, step_line
from arborl.report.metrics import MetricsLog, summary_table

__all__ = ["MetricsLog", "idle_reason", "idle_warning", "plot_run", "plural", "run_figure",
           "step_line", "summary_table"]
