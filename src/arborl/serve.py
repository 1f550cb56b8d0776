"""``arborl serve [CONFIG] [--host H] [--port N] [--set k=v ...]``: model, engines, data pool and the
gateway in the foreground. The first line on stdout is the base URL (``http://HOST:PORT/v1``);
everything else goes to stderr. Ctrl-C (or SIGTERM) stops it gracefully: requests in flight finish
and are recorded, then engines and the data pool close. The config goes to runs/<name>/config.yaml
(serve.config.yaml when that run directory already has a config). A trained policy is served with
``--set model.source=hf --set model.path=runs/<name>/checkpoint``.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from arborl.run.assemble import build_gateway
from arborl.config import dump_config, load_config
from arborl.dashboard import create_app as dashboard_app
from arborl.extensions import check_extensions
from arborl.gateway.server import bind, serve_forever


def run_serve(config: Path | None, host: str | None, port: int | None, overrides: list[str], console: Console) -> None:
    cfg = load_config(config, overrides)
    check_extensions(cfg)
    host = host or cfg.gateway.host
    port = cfg.gateway.port if port is None else port
    run_dir = cfg.run_dir
    sock = bind(host, port)  # fail fast, before loading the model, when the port is taken
    console.print(f"loading {cfg.model.source} model and {cfg.gateway.num_engines} engine(s) ...")
    try:
        launched = build_gateway(cfg)
    except BaseException:
        sock.close()
        raise
    # written once the model has loaded; a training run's own config.yaml is never replaced
    config_file = run_dir / "config.yaml"
    (config_file if not config_file.exists() else run_dir / "serve.config.yaml").write_text(dump_config(cfg))
    gw = launched.gateway
    key_given = bool(os.environ.get("ARBORL_ADMIN_KEY") or cfg.gateway.admin_key)

    def ready(actual_port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{actual_port}/v1"
        print(url, flush=True)
        console.print(f"arborl gateway: model {gw.model_name!r} on {url}; data pool {launched.pool.path}")
        if key_given:
            console.print("admin key: from ARBORL_ADMIN_KEY / gateway.admin_key")
        else:
            console.print(f"admin key (generated; set ARBORL_ADMIN_KEY to choose one): {gw.admin_key}")
        console.print("create a session: POST /v1/sessions with the admin key; Ctrl-C stops")
        console.print(f"dashboard of the runs in {cfg.runs_dir}: {url[:-3]}/dashboard/")

    try:
        serve_forever(gw, sock, on_ready=ready, mounts={"/dashboard": dashboard_app([cfg.runs_dir])})
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; the shutdown was graceful
        pass
    finally:
        launched.close()
        console.print(f"stopped: {gw.stats.calls_recorded} call(s) recorded in {len(gw.sessions.all())} session(s)")
