"""Run outputs: metrics.jsonl, summary.json, plots, the end-of-run table."""

from arborl.report.metrics import MetricsLog, plot_curves, summary_table

__all__ = ["MetricsLog", "plot_curves", "summary_table"]
