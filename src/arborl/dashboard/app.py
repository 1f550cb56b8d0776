"""The dashboard's FastAPI app: HTML pages (curves, rollout timeline, trajectory browser, config) that
fetch JSON from ``api/...`` and draw it with Plotly, whose JavaScript is served from the ``plotly``
Python package (no CDN: works offline). Every request re-reads the run directory and the data pool,
so a running job's new steps show on the next load or poll. Runs are the directories given (or found
directly inside them) when the app is made; ``run`` parameters name them by key (``GET api/runs``)."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from arborl.dashboard import pool
from arborl.dashboard.faithfulness import AuditCache
from arborl.dashboard.knobs import knob_rows, redact
from arborl.dashboard.runs import WELL_KNOWN, Run, eval_series, find_runs, metric_columns, run_keys, time_split
from arborl.dashboard.timeline import step_figure, timeline_steps
from arborl.dashboard.trajectory import episode_view, run_tokenizer
from arborl.types import ArborlError

PAGES = {"": "runs", "curves": "curves", "timeline": "rollout timeline", "trajectories": "trajectories",
         "audit": "token audit", "config": "config and knobs"}
STATIC = resources.files("arborl.dashboard") / "static"


def _finite(obj: Any) -> Any:
    """JSON has no NaN / Infinity: they become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json(obj: Any) -> Response:
    return Response(json.dumps(_finite(obj), default=str), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


class PlotlyMissingError(ArborlError):
    """The plotly package (the charts' JavaScript) is not installed."""


def plotly_js() -> Path:
    """plotly.min.js as the plotly package ships it."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise PlotlyMissingError("the dashboard draws its charts with Plotly, which is not installed: "
                                 "pip install 'arborl[dashboard]'")
    return Path(spec.origin).parent / "package_data" / "plotly.min.js"


def create_app(paths: list[str | Path]) -> FastAPI:
    """The dashboard over the run directories in (or directly under) ``paths``; RunNotFoundError for a
    path that does not exist. Directories that become runs later show after a restart."""
    runs = run_keys(find_runs(paths))
    app = FastAPI(title="arborl dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    def run_of(key: str) -> Run:
        if key not in runs:
            raise HTTPException(404, f"unknown run {key!r}; runs: {', '.join(runs) or 'none'} (GET api/runs)")
        return Run(runs[key])

    audits = AuditCache()

    @functools.lru_cache(maxsize=16)
    def tokenizer(key: str):
        return run_tokenizer(runs[key])

    shell = (STATIC / "page.html").read_text()

    def page(name: str):
        def render(request: Request) -> HTMLResponse:
            base = request.scope.get("root_path", "").rstrip("/") + "/"
            nav = "".join(f'<a href="{p or "."}"{" class=on" if p == name else ""}>{t}</a>' for p, t in PAGES.items())
            html = (shell.replace("__BASE__", base).replace("__PAGE__", name or "runs")
                    .replace("__TITLE__", PAGES[name]).replace("__NAV__", nav))
            return HTMLResponse(html, headers={"Cache-Control": "no-store"})

        return render

    for name in PAGES:
        app.add_api_route("/" + name, page(name), methods=["GET"], response_class=HTMLResponse)

    @app.get("/static/plotly.min.js")
    def _plotly() -> FileResponse:
        try:
            return FileResponse(plotly_js(), media_type="text/javascript")
        except PlotlyMissingError as e:
            raise HTTPException(404, str(e)) from None

    @app.get("/static/{name}")
    def _static(name: str) -> Response:
        f = STATIC / name
        if name not in ("app.js", "style.css") or not f.is_file():
            raise HTTPException(404, f"no static file {name!r}")
        return Response(f.read_text(), media_type="text/javascript" if name.endswith(".js") else "text/css")

    @app.get("/api/runs")
    def _runs() -> Response:
        return _json([{"key": k, "path": str(p), "headline": Run(p).headline()} for k, p in runs.items()])

    @app.get("/api/curves")
    def _curves(run: list[str] = Query(default=[])) -> Response:
        keys = run or list(runs)
        data = {k: run_of(k).rows() for k in keys}
        columns = metric_columns([r for rows in data.values() for r in rows])
        known = sum(c in WELL_KNOWN for c in columns)  # they come first; the page draws the rest on demand
        return _json({"columns": columns, "known": known, "runs": {
            k: {**{kind: [r for r in rows if r.get("kind") == kind] for kind in ("step", "eval")},
                "eval_series": eval_series(rows), "time_split": time_split(rows)}
            for k, rows in data.items()}})

    @app.get("/api/timeline")
    def _timeline(run: str, step: int | None = None) -> Response:
        path = run_of(run).path
        steps = timeline_steps(path)
        if step is None:
            if not steps:
                return _json({"steps": [], "step": None})
            step = steps[-1]
        if step not in steps:
            raise HTTPException(404, f"run {run!r} has no timeline for step {step}; steps with one: "
                                     f"{', '.join(map(str, steps)) or 'none (scheduling.timeline=false?)'}")
        return _json({"steps": steps, "step": step, **step_figure(path, step)})

    @app.get("/api/groups")
    def _groups(run: str) -> Response:
        try:
            return _json(pool.buckets(run_of(run).datapool_file()))
        except pool.NoDataPoolError as e:
            raise HTTPException(404, str(e)) from None

    @app.get("/api/episodes")
    def _episodes(run: str, group: str) -> Response:
        try:
            eps = pool.group_episodes(run_of(run).datapool_file(), group)
        except pool.NoDataPoolError as e:
            raise HTTPException(404, str(e)) from None
        if not eps:
            raise HTTPException(404, f"run {run!r} has no episodes in group {group!r} (GET api/groups lists them)")
        return _json([{"episode_id": e.episode_id, "task_id": e.task_id, "status": e.status.value, "reward": e.reward,
                       "reward_components": e.reward_components} for e in eps])

    @app.get("/api/episode")
    def _episode(run: str, id: str) -> Response:
        r = run_of(run)
        try:
            ep = pool.episode(r.datapool_file(), id)
        except pool.NoDataPoolError as e:
            raise HTTPException(404, str(e)) from None
        if ep is None:
            raise HTTPException(404, f"run {run!r} has no episode {id!r}")
        return _json(episode_view(ep, tokenizer(run), pool.trainer_logprobs(r.datapool_file(), id),
                                  tempered=r.tempered()))

    @app.get("/api/audit")
    def _audit(run: str, examples: int = Query(default=5, ge=0, le=50)) -> Response:
        """`arborl audit`'s answer for the run, computed on request (the tokenizer, the whole data pool) and
        kept until the data pool changes."""
        r = run_of(run)
        try:
            return _json(audits.audit(r.path, r.datapool_file(), examples))
        except ArborlError as e:  # no data pool, no tokenizer (arborl.show.ShowError), an unreadable config
            raise HTTPException(404, f"run {run!r}: {e}") from None

    @app.get("/api/config")
    def _config(run: str) -> Response:
        r = run_of(run)
        data = redact(r.config_data())
        return _json({"path": str(r.path), "config_yaml": yaml.safe_dump(data, sort_keys=False) if data else "",
                      "changes": redact(r.changes()), "summary": r.summary(), "knobs": knob_rows(data)})

    return app
