"""``arborl serve`` as a user runs it: a subprocess that prints its base URL, serves the official
openai client, records into the run's data pool, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from arborl.datapool import DataPool


def test_serve_prints_the_url_serves_and_stops_on_ctrl_c(tmp_path: Path):
    env = {**os.environ, "ARBORL_ADMIN_KEY": "cli-admin", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "arborl.cli", "serve", "--port", "0",
           "--set", "model.source=tiny", "--set", "model.tiny_tokenizer=smollm2", "--set", f"runs_dir={tmp_path}",
           "--set", "name=svc", "--set", "engine.max_seq_len=256", "--set", "engine.num_threads=1",
           "--set", "gateway.num_engines=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), (url, proc.stderr.read() if proc.poll() is not None else "")
        s = httpx.post(url + "/sessions", json={"task_id": "cli"}, headers={"Authorization": "Bearer cli-admin"}, timeout=30).json()
        assert s["base_url"] == url
        c = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        r = c.chat.completions.create(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens >= 1 and r.policy_version == 0
        assert len(httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()["engines"]) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopped: 1 call(s) recorded in 1 session(s)" in err and "cli-admin" not in err
    pool = DataPool(tmp_path / "svc" / "datapool.sqlite")
    (ep,) = pool.episodes()
    assert ep.task_id == "cli" and len(ep.calls) == 1 and (tmp_path / "svc" / "config.yaml").is_file()
    pool.close()


def test_serve_reports_a_bad_config_and_a_taken_port(tmp_path: Path):
    bad = subprocess.run([sys.executable, "-m", "arborl.cli", "serve", "--set", "gateway.num_engines=0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gateway.num_engines" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "arborl.cli", "serve", "--port", str(port), "--set", "model.source=tiny"],
                              capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr and "--port" in busy.stderr
