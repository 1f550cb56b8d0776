"""The server supervisor (engine/backends/server.py) with a real subprocess standing in for vLLM: a
small HTTP server answering /health. Started, killed, restarted up to engine.vllm.max_restarts
times; a server that never answers fails after startup_timeout_s with its log's tail; model
directories: one per version, the older ones deleted once the server serves the new one."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import safetensors.torch
import torch

from arborl.engine.backends.base import BackendError, ServerUnavailableError
from arborl.engine.backends.model_dir import ModelDirs
from arborl.engine.backends.server import ServerProcess, free_port
from arborl.models import tiny_llama

SERVER = """
import http.server, sys
print("fake server starting", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
SILENT = "import time; print('loading forever', flush=True); time.sleep(60)"


def make(tmp_path, code: str, *, max_restarts: int = 1, timeout: float = 30.0, restarted=None) -> ServerProcess:
    script = tmp_path / "server.py"
    script.write_text(code)
    port = free_port()
    return ServerProcess("fake", lambda: [sys.executable, str(script), str(port)], env=dict(os.environ),
                         url=f"http://127.0.0.1:{port}", log_path=tmp_path / "server.log", startup_timeout_s=timeout,
                         max_restarts=max_restarts, on_restart=restarted)


def wait_for(cond, seconds: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < seconds, "timed out"
        time.sleep(0.05)


def test_a_killed_server_is_restarted_until_max_restarts(tmp_path):
    seen = []
    srv = make(tmp_path, SERVER, max_restarts=1, restarted=lambda: seen.append(srv.pid))
    srv.start()
    try:
        first = srv.pid
        assert srv.ready
        os.killpg(first, signal.SIGKILL)
        wait_for(lambda: srv.restarts == 1 and srv.ready)
        assert srv.pid != first and seen == [srv.pid]
        srv.wait_ready(timeout=5)
        os.killpg(srv.pid, signal.SIGKILL)  # the second death is one too many
        wait_for(lambda: srv.failure is not None)
        with pytest.raises(ServerUnavailableError, match="restarted 1 times"):
            srv.wait_ready(timeout=5)
    finally:
        srv.stop()


# vLLM's shape: the server and an engine child of its process group each hold a multiprocessing
# shared-memory segment (vLLM's message queues) and print its name
SHM_SERVER = SERVER.replace("print(\"fake server starting\", flush=True)", """
import subprocess
from multiprocessing import shared_memory
own = shared_memory.SharedMemory(create=True, size=1 << 20)
child = subprocess.Popen([sys.executable, "-c", "from multiprocessing import shared_memory; import time; "
                          "s = shared_memory.SharedMemory(create=True, size=1 << 20); print('shm', s.name, flush=True); "
                          "time.sleep(600)"])
print("shm", own.name, flush=True)
""")


def shm_in_log(tmp_path, count: int) -> list[str]:
    def names():
        return [line.split()[1].lstrip("/") for line in (tmp_path / "server.log").read_text().splitlines()
                if line.startswith("shm ")]
    wait_for(lambda: len(names()) >= count)
    return names()


def test_shared_memory_a_killed_or_stopped_server_leaves_is_removed_and_others_stay(tmp_path):
    from arborl.engine.backends.orphan_shm import SHM

    srv = make(tmp_path, SHM_SERVER, max_restarts=1)
    mine, held = SHM / f"psm_arborl_test_{os.getpid()}", None
    srv.start()
    try:
        first = shm_in_log(tmp_path, 2)
        assert all((SHM / n).exists() for n in first)
        held = open(mine, "wb")  # noqa: SIM115 - another program's segment, made meanwhile and open: it stays
        os.killpg(srv.pid, signal.SIGKILL)  # as a crash: nothing of the group unlinks anything
        wait_for(lambda: srv.restarts == 1 and srv.ready)
        assert not any((SHM / n).exists() for n in first)
        second = shm_in_log(tmp_path, 4)[2:]
        assert all((SHM / n).exists() for n in second)
    finally:
        srv.stop()
        survived = mine.exists()
        if held is not None:
            held.close()
        mine.unlink(missing_ok=True)
    assert not any((SHM / n).exists() for n in second)  # stopped: its SIGTERM unlinked nothing either
    assert survived


def test_a_server_that_never_answers_fails_after_the_startup_timeout(tmp_path):
    srv = make(tmp_path, SILENT, timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="within 2 s[\\s\\S]*loading forever"):
        srv.start()
    assert time.monotonic() - t0 < 30 and srv.pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.pid, 0)  # nothing of it is left


def test_model_dirs_keep_one_version_and_write_tied_models_untied(tmp_path):
    model = tiny_llama(vocab=64, hidden=32, tie_embeddings=True)
    dirs = ModelDirs(tmp_path / "work", model, version=0)
    config = json.loads((dirs.current / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert model.config.tie_word_embeddings  # the model itself is left as it was
    state = {k: v + 1 for k, v in model.state_dict().items()}
    v1 = dirs.write(state, 1)
    assert (v1 / "model.safetensors").is_file() and (v1 / "config.json").is_file()
    dirs.commit(v1)
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["v1"]
    saved = safetensors.torch.load_file(str(v1 / "model.safetensors"))
    # vLLM's in-place reload does not refresh a tied head: the head is a weight of its own on disk
    assert torch.equal(saved["lm_head.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(saved["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
