"""The client of ``vllm_worker.py``: vLLM's offline API in a persistent subprocess of vLLM's own
interpreter, fed the token ids arborl's bench uses, on the same cores as arborl. While arborl's engine
is measured the worker is stopped (SIGSTOP, ``EngineWorker.stopped``): idle, vLLM's engine still
polls (measured: ~0.1 core over 10 s), and arborl's engine, idle while vLLM runs, uses none."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from arborl.engine.backends.base import BackendError
from arborl.engine.backends.model_dir import ModelDirs, default_work_dir
from arborl.engine.backends.vllm import VLLM_VENV_PYTHON, resolve_python
from arborl.models import LoadedModel

WORKER = Path(__file__).with_name("vllm_worker.py")


def bench_cores() -> list[int]:
    """The cores both engines run on: the first two this process may use (the issue's anchor)."""
    return sorted(os.sched_getaffinity(0))[:2]


def _group_states(pgid: int) -> list[str]:
    """The scheduler state (R, S, T, ...) of every process in process group ``pgid`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(fields[0])
    return out


class WorkerError(BackendError):
    """The worker failed to start or to answer."""


class EngineWorker:
    """One worker process; ``backend`` "vllm" (vLLM's interpreter) or "transformers" (this one, for tests)."""

    def __init__(self, loaded: LoadedModel, *, backend: str = "vllm", python: str | None = None,
                 max_model_len: int = 1024, max_num_seqs: int = 32, prefix_caching: bool = True,
                 kv_cache_gib: float = 2) -> None:
        if python is None:
            python = sys.executable if backend != "vllm" else resolve_python(
                VLLM_VENV_PYTHON, "vLLM", "run `make vllm` to get the vLLM column")
        self.work_dir = default_work_dir("arborl-bench-worker-")
        ModelDirs(self.work_dir, loaded.model, 0)
        env = dict(os.environ)
        env.pop("VIRTUAL_ENV", None)
        cores = bench_cores()
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}"
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
        self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if backend == "vllm" else None, text=True, env=env,
                                     start_new_session=True)  # its own process group: stopped as one
        ready = self.call({"backend": backend, "model": str(self.work_dir / "v0"), "max_model_len": max_model_len,
                           "max_num_seqs": max_num_seqs, "prefix_caching": prefix_caching,
                           "eos_token_ids": list(loaded.eos_token_ids)})
        self.startup_s = float(ready["startup_s"])

    def call(self, msg: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(f"the engine worker died ({e})") from None
        if not line:
            raise WorkerError(f"the engine worker exited (code {self.proc.poll()}) without answering")
        out = json.loads(line)
        if "error" in out:
            raise WorkerError(f"the engine worker failed: {out['error']}")
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> tuple[float, list[list[int]]]:
        out = self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos})
        return out["seconds"], out["token_ids"]

    def multiturn(self, convo: list[list[int]], follow: list[list[list[int]]], max_tokens: int) -> dict:
        return self.call({"op": "multiturn", "convo": convo, "follow": follow, "max_tokens": max_tokens})

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """The worker and every process it started stopped for the block, continued after it."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while not all(state in "Tt" for state in _group_states(self.proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.01)  # the signal is delivered asynchronously: wait until every process took it
            yield
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "quit"})
            except WorkerError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.work_dir, ignore_errors=True)
