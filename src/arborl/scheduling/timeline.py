"""Rollout timeline: per request submit / start / chunk / finish / cancel events, and a Gantt PNG.

Each *span* is one assignment of a request to an engine instance (one chunk under divided
rollout, the whole request otherwise): [start, end) on ``instance``, ``tokens`` new tokens, and
why it ended (``chunk``: comes back for more, ``finish``: done, ``cancel``: aborted). The simulator
and the real controllers record into the same class; ``gantt`` draws one row per request, grouped
by the instance of its first span, coloured by instance, probes marked, with a legend.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Span:
    request_id: str
    group_id: str
    instance: int
    start: float  # seconds (simulated or wall) since the run began
    end: float
    tokens: int
    ended: str  # "chunk" | "finish" | "cancel"
    version: int = 0  # policy version of the instance when the span started
    probe: bool = False
    step: int = 0  # trainer version when the request's item started


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # submit / train / publish markers
    _open: dict[str, dict] = field(default_factory=dict)

    def submit(self, t: float, request_id: str, group_id: str) -> None:
        self.events.append({"t": t, "kind": "submit", "request_id": request_id, "group_id": group_id})

    def start(self, t: float, request_id: str, group_id: str, instance: int, *, version: int = 0,
              probe: bool = False, step: int = 0) -> None:
        self._open[request_id] = dict(request_id=request_id, group_id=group_id, instance=instance, start=t,
                                      version=version, probe=probe, step=step)

    def end(self, t: float, request_id: str, tokens: int, ended: str, *, step: int | None = None) -> None:
        """Close the request's open span; ``step`` (if given) re-stamps it with the step it ended in."""
        o = self._open.pop(request_id, None)
        if o is not None:
            if step is not None:
                o["step"] = step
            self.spans.append(Span(end=t, tokens=tokens, ended=ended, **o))

    def add_calls(self, calls, *, group_id: str, step: int, t0: float) -> None:
        """Spans of recorded gateway calls (``arborl.types.Call``: finished at ``created_at`` after
        ``latency_s``); ``t0`` is the wall time (time.time()) the timeline starts at."""
        for c in calls:
            tail = c.engine_id.rsplit("-", 1)[-1]
            end = c.created_at - t0
            vs = c.versions or [0]
            self.spans.append(Span(c.call_id, group_id, int(tail) if tail.isdigit() else 0, end - c.latency_s, end,
                                   len(c.completion_token_ids), "finish" if c.finish_reason != "abort" else "cancel",
                                   version=min(vs), step=step))

    def mark(self, t: float, kind: str, **info) -> None:
        self.events.append({"t": t, "kind": kind, **info})

    def write_jsonl(self, path: str | Path, *, step: int | None = None, append: bool = False) -> None:
        """Spans (and markers) as JSON lines; ``step`` keeps one trainer step's."""
        with open(path, "a" if append else "w") as f:
            for s in self.spans:
                if step is None or s.step == step:
                    f.write(json.dumps({"kind": "span", **asdict(s)}) + "\n")
            for e in self.events:
                if step is None or e.get("step") == step:
                    f.write(json.dumps(e) + "\n")

    def gantt(self, path: str | Path, *, title: str = "rollout timeline", step: int | None = None,
              max_rows: int = 4000) -> Path:
        """One row per request (grouped by instance), a bar per span; ``step`` keeps one trainer step."""
        import matplotlib.pyplot as plt

        fig = self.gantt_figure(title=title, step=step, max_rows=max_rows)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def gantt_figure(self, *, title: str = "rollout timeline", step: int | None = None, max_rows: int = 4000):
        """The matplotlib figure :meth:`gantt` saves."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D

        spans = [s for s in self.spans if step is None or s.step == step]
        first: dict[str, Span] = {}
        for s in sorted(spans, key=lambda s: s.start):
            first.setdefault(s.request_id, s)
        order = sorted(first, key=lambda r: (first[r].instance, first[r].start))[:max_rows]
        row = {r: i for i, r in enumerate(order)}
        n_inst = max((s.instance for s in spans), default=0) + 1
        cmap = plt.get_cmap("tab20")
        height = min(12.0, 3.0 + 0.004 * len(order) + 0.25 * min(n_inst, 8))
        fig, ax = plt.subplots(figsize=(12, height))
        for s in spans:
            if s.request_id not in row:
                continue
            y = row[s.request_id]
            color = "#999999" if s.ended == "cancel" else cmap(s.instance % 20)
            ax.hlines(y, s.start, s.end, colors=[color], linewidth=max(0.6, min(4.0, 300 / max(1, len(order)))))
            if s.probe:
                ax.plot([s.start], [y], marker="|", color="black", markersize=3)
        for e in self.events:
            if e["kind"] in ("train", "publish") and (step is None or e.get("step") == step):
                ax.axvline(e["t"], color="red" if e["kind"] == "publish" else "orange", linewidth=0.6, alpha=0.6)
        shown = sorted({s.instance for s in spans})
        handles = [Line2D([], [], color=cmap(i % 20), lw=3, label=f"engine instance {i}") for i in shown[:8]]
        if len(shown) > 8:
            handles.append(Line2D([], [], color="none", label=f"... {len(shown) - 8} more instances"))
        marks = {e["kind"] for e in self.events if step is None or e.get("step") == step}
        extra = [
            (any(s.ended == "cancel" for s in spans), Line2D([], [], color="#999999", lw=3, label="cancelled / aborted")),
            (any(s.probe for s in spans), Line2D([], [], color="black", marker="|", lw=0, label="probe request")),
            ("train" in marks, Line2D([], [], color="orange", lw=1, label="trainer step")),
            ("publish" in marks, Line2D([], [], color="red", lw=1, label="weights published")),
        ]
        handles += [h for present, h in extra if present]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.set_xlabel("time (s)")
        ax.set_ylabel(f"requests ({len(order)}), grouped by instance ({n_inst})")
        ax.set_title(title)
        ax.invert_yaxis()
        fig.tight_layout()
        return fig
