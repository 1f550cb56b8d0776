"""The tables ``arborl runs`` and ``arborl compare`` print."""

from __future__ import annotations

from rich.table import Table

from arborl.dashboard.runs import WELL_KNOWN, Run, format_value


def _short(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else format_value(v)


def _arrow(a, b) -> str:
    return _short(a) if b is None else f"{_short(a)}→{_short(b)}"


def runs_table(runs: list[Run], title: str = "runs") -> Table:
    """One row per run: its headline figures, compactly (first→last where a figure moves; eval: held-out success)."""
    table = Table(title=title, box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for c in ("run", "task", "steps", "state", "reward", "success", "eval", "s/step", "tok/s", "updated"):
        table.add_column(c, justify="left" if c in ("run", "task", "state", "updated") else "right",
                         no_wrap=c in ("run", "updated"))
    for r in runs:
        h = r.headline()
        table.add_row(h["run"], format_value(h["task"]), h["steps"], h["state"],
                      _arrow(h["reward_first"], h["reward_last"]),
                      _short(h["success_last"]), _arrow(h["eval_success_first"], h["eval_success_last"]),
                      _short(h["mean_step_s"]), _short(h["mean_tokens_per_s"]), h["updated"])
    return table


def compare_table(runs: list[Run]) -> Table:
    """The runs side by side: their headline figures, then the last step's value of each well-known
    metric any of them logged."""
    heads = [r.headline() for r in runs]
    last = []
    for r in runs:
        steps = [x for x in r.rows() if x.get("kind") == "step"]
        last.append(steps[-1] if steps else {})
    table = Table(title="compare")
    table.add_column("figure")
    for h in heads:
        table.add_column(h["run"], justify="right")
    for key in heads[0] if heads else []:
        if key != "run":
            table.add_row(key, *(format_value(h[key]) for h in heads))
    for key in WELL_KNOWN:
        if any(key in x for x in last):
            table.add_row(f"last {key}", *(format_value(x.get(key)) for x in last))
    return table
