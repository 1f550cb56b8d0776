"""A step's rollout timeline (timeline/spans.jsonl, written by the controller) as a Plotly Gantt figure:
one horizontal bar per span (a whole request, or one piece of it under the dispatcher) on the row of its
request, coloured by engine instance; cancelled pieces grey; probes and migrations (a piece on another
instance than the request's previous piece) marked; publish / train events as vertical lines. The figure
is plain JSON for ``Plotly.react``: zoom and pan are Plotly's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPANS_FILE = Path("timeline") / "spans.jsonl"
MAX_BARS = 5000  # a step with more spans shows its first MAX_BARS (by start) and says so
# Plotly's default qualitative palette, so engine colours match the curves' look
PALETTE = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff",
           "#fecb52")


def read_spans(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(spans, events) of the whole run, as recorded."""
    f = run_dir / SPANS_FILE
    spans, events = [], []
    if f.is_file():
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line being written by the running job
                continue
            (spans if rec.get("kind") == "span" else events).append(rec)
    return spans, events


def timeline_steps(run_dir: Path) -> list[int]:
    """The training steps (1-based, as metrics.jsonl counts them) that have spans."""
    spans, _ = read_spans(run_dir)
    return sorted({int(s.get("step", 0)) + 1 for s in spans})


def _label(s: dict[str, Any]) -> str:
    return f"{s['request_id'][-8:]} {s.get('group_id', '')}"


def step_figure(run_dir: Path, step: int) -> dict[str, Any]:
    """The Plotly figure of training step ``step`` (1-based) and counts: {"figure", "bars", "requests",
    "probes", "migrations", "truncated"}."""
    spans_all, events = read_spans(run_dir)
    spans = sorted((s for s in spans_all if int(s.get("step", 0)) + 1 == step), key=lambda s: s["start"])
    truncated = max(0, len(spans) - MAX_BARS)
    spans = spans[:MAX_BARS]
    first: dict[str, dict[str, Any]] = {}
    for s in spans:
        first.setdefault(s["request_id"], s)
    rows = sorted(first, key=lambda r: (first[r]["instance"], first[r]["start"]))
    labels = {r: _label(first[r]) for r in rows}
    prev_instance: dict[str, int] = {}
    migrated: list[dict[str, Any]] = []
    for s in spans:
        before = prev_instance.get(s["request_id"])
        if before is not None and before != s["instance"]:
            migrated.append(s)
        prev_instance[s["request_id"]] = s["instance"]

    def bars(group: list[dict[str, Any]], name: str, color: str) -> dict[str, Any]:
        return {
            "type": "bar", "orientation": "h", "name": name,
            "marker": {"color": color, "line": {"color": "white", "width": 1}},
            "y": [labels[s["request_id"]] for s in group], "base": [s["start"] for s in group],
            "x": [max(s["end"] - s["start"], 1e-6) for s in group],
            "customdata": [[s["request_id"], s.get("group_id", ""), s["instance"], s["tokens"], s["ended"],
                            s.get("version", 0), bool(s.get("probe"))] for s in group],
            "hovertemplate": "request %{customdata[0]}<br>group %{customdata[1]}<br>engine %{customdata[2]}<br>"
                             "%{customdata[3]} tokens, %{base:.3f}s + %{x:.3f}s<br>ended: %{customdata[4]}, "
                             "version %{customdata[5]}, probe %{customdata[6]}<extra></extra>",
        }

    traces = []
    for inst in sorted({s["instance"] for s in spans}):
        group = [s for s in spans if s["instance"] == inst and s["ended"] != "cancel"]
        if group:
            traces.append(bars(group, f"engine {inst}", PALETTE[inst % len(PALETTE)]))
    cancelled = [s for s in spans if s["ended"] == "cancel"]
    if cancelled:
        traces.append(bars(cancelled, "cancelled / aborted", "#999999"))
    probes = [s for s in spans if s.get("probe")]
    for group, name, symbol, color in ((probes, "probe", "triangle-right", "black"),
                                       (migrated, "migration", "x", "#d62728")):
        if group:
            traces.append({"type": "scatter", "mode": "markers", "name": name,
                           "marker": {"symbol": symbol, "color": color, "size": 9},
                           "x": [s["start"] for s in group], "y": [labels[s["request_id"]] for s in group],
                           "hovertemplate": f"{name}: %{{y}} at %{{x:.3f}}s<extra></extra>"})
    marks = [e for e in events if e.get("kind") in ("publish", "train") and int(e.get("step", -1)) + 1 == step]
    shapes = [{"type": "line", "xref": "x", "yref": "paper", "x0": e["t"], "x1": e["t"], "y0": 0, "y1": 1,
               "line": {"color": "red" if e["kind"] == "publish" else "orange", "width": 1.5, "dash": "dot"}}
              for e in marks]
    annotations = [{"x": e["t"], "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom", "showarrow": False,
                    "text": "weights published" if e["kind"] == "publish" else "trainer step",
                    "font": {"size": 10, "color": "red" if e["kind"] == "publish" else "orange"}} for e in marks]
    figure = {
        "data": traces,
        "layout": {
            "barmode": "overlay", "height": max(340, 140 + 20 * len(rows)), "dragmode": "zoom",
            "margin": {"l": 20, "r": 20, "t": 40, "b": 100}, "shapes": shapes, "annotations": annotations,
            "xaxis": {"ticksuffix": " s"},  # seconds since the run started
            "yaxis": {"type": "category", "categoryorder": "array", "categoryarray": [labels[r] for r in rows],
                      "autorange": "reversed", "automargin": True},
            "legend": {"orientation": "h", "y": -0.14, "yanchor": "top"},
        },
    }
    return {"figure": figure, "bars": len(spans), "requests": len(rows), "probes": len(probes),
            "migrations": len(migrated), "truncated": truncated}
