"""The trainer ranks: ``RankGroup`` starts ``train.parallel.ranks`` rank processes of this host
(``cluster.rank_actors.RayRankGroup``: Ray actors placed by a placement group, the same protocol)
and drives them like one trainer (train_step, engine_state, checkpoints).

Each rank is ``python -m arborl.train.ranks`` with torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): it joins the process group
with ``init_process_group(init_method="env://")``, exactly as under ``torchrun``, and takes its
commands from the driver over an authenticated connection (``ARBORL_RANK_CONTROL``). The
driver sends every rank the same command; a rank that raises, exits or stops answering tears the
whole group down (each rank is its own process group, killed with SIGKILL after a grace period),
and the caller gets a :class:`RankError`. ``close()`` (and the end of a ``with`` block, Ctrl-C
included) leaves no rank process behind.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

import torch
from torch import nn

from arborl.config import TrainConfig
from arborl.types import ArborlError, Sample

CONTROL_ENV = "ARBORL_RANK_CONTROL"  # host:port of the driver's listener
AUTHKEY_ENV = "ARBORL_RANK_AUTHKEY"  # hex
PARENT_ENV = "ARBORL_RANK_PARENT"  # pid of the driver


def _send(conn: Connection, obj: Any) -> None:
    # plain pickle (torch's multiprocessing reducers would pass tensors as file descriptors of another
    # process's shared memory, which a Listener connection cannot hand over)
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class RankError(ArborlError):
    """A rank failed (raised, exited, or did not answer in time); the group has been torn down."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, master_port: int, *, master_addr: str = "127.0.0.1", threads: int = 1,
             local_rank: int | None = None, local_world: int | None = None, node_rank: int = 0) -> dict[str, str]:
    """torchrun's variables for one rank (+ the thread count); a single-node group by default."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank if local_rank is None else local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world), "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": str(threads),
    }


class _LocalRank(subprocess.Popen):
    """A rank process of this host (its own session, killed with everything it started)."""

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class RankGroup:
    """``cfg.parallel.ranks`` trainer ranks started from this process, driven like one trainer.

    ``model``: the policy (sent to every rank, which shards it) or a picklable callable that builds
    it in the rank (a large model: each rank loads it itself). The ranks are child processes here;
    ``cluster.rank_actors.RayRankGroup`` places them as Ray actors instead (``_launch``)."""

    control_host = "127.0.0.1"  # where the ranks reach this process

    def __init__(self, model: nn.Module | Callable[[], nn.Module], cfg: TrainConfig, *, temperature: float = 1.0,
                 start_timeout_s: float = 300.0) -> None:
        from arborl.train.parallel import check_supported

        check_supported(cfg)
        self.cfg = cfg
        self.world = cfg.parallel.ranks
        self.timeout_s = cfg.parallel.timeout_s
        self.step = 0
        self.procs: list[Any] = []  # subprocess.Popen-like: pid, poll(), wait(timeout), returncode, kill()
        self.conns: list[Connection] = []
        authkey = secrets.token_bytes(16)
        listener = Listener((self.control_host, 0), authkey=authkey)
        control = {CONTROL_ENV: f"{self.control_host}:{listener.address[1]}", AUTHKEY_ENV: authkey.hex()}
        try:
            self._launch(control, start_timeout_s)
            self.conns = self._accept(listener, start_timeout_s)
            self._call("init", model, cfg.model_dump(), temperature, timeout=start_timeout_s)
        except BaseException:
            self.close(force=True)
            raise
        finally:
            listener.close()

    def _launch(self, control: dict[str, str], timeout: float) -> None:
        """Start the rank processes (into ``self.procs``); each reaches this process through ``control``."""
        master_port = free_port()
        src = str(Path(__file__).resolve().parents[2])  # this arborl, first on the ranks' path
        for r in range(self.world):
            env = {**os.environ, **rank_env(r, self.world, master_port, threads=self.cfg.parallel.threads_per_rank),
                   **control, PARENT_ENV: str(os.getpid()),
                   "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
            self.procs.append(_LocalRank([sys.executable, "-m", "arborl.train.ranks"], env=env, start_new_session=True))

    # -- plumbing ---------------------------------------------------------------------------------
    def _accept(self, listener: Listener, timeout: float) -> list[Connection]:
        got: dict[int, Connection] = {}
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                while len(got) < self.world:
                    conn = listener.accept()
                    got[_recv(conn)] = conn
            except BaseException as e:  # the listener closed under us (a rank died): reported below
                errors.append(e)

        thread = threading.Thread(target=accept, daemon=True, name="arborl-rank-accept")
        thread.start()
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                raise RankError(f"rank {dead[0]} exited with {self.procs[dead[0]].returncode} while starting")
            if time.monotonic() > deadline or errors:
                raise RankError(f"the ranks did not connect within {timeout:.0f} s ({len(got)}/{self.world})")
            thread.join(0.1)
        return [got[r] for r in range(self.world)]

    def _call(self, cmd: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Send ``cmd`` to every rank and collect their answers (rank order); tears down on failure."""
        if not self.conns:
            raise RankError("the rank group is closed")
        try:
            for c in self.conns:
                _send(c, (cmd, args))
            return self._collect(timeout or self.timeout_s)
        except RankError:
            self.close(force=True)
            raise
        except (OSError, EOFError) as e:  # a rank's connection broke: the rank died (killed, its node lost)
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            self.close(force=True)
            raise RankError(f"the connection to the trainer ranks broke ({type(e).__name__}: {e}); "
                            f"rank(s) {dead or '?'} had exited") from e
        except BaseException:  # Ctrl-C: nothing is left running
            self.close(force=True)
            raise

    def _collect(self, timeout: float) -> list[Any]:
        answers: dict[int, Any] = {}
        index = {id(c): r for r, c in enumerate(self.conns)}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world:
            pending = [c for r, c in enumerate(self.conns) if r not in answers]
            for c in wait(pending, timeout=0.2):
                r = index[id(c)]
                try:
                    kind, value = _recv(c)
                except (EOFError, OSError):
                    raise RankError(f"rank {r} exited (code {self.procs[r].wait(5)})") from None
                if kind == "error":
                    raise RankError(f"rank {r} failed:\n{value}")
                answers[r] = value
            for r, p in enumerate(self.procs):
                if r not in answers and p.poll() is not None:
                    raise RankError(f"rank {r} exited with code {p.returncode}")
            if time.monotonic() > deadline:
                raise RankError(f"the ranks did not answer within {timeout:.0f} s (train.parallel.timeout_s)")
        return [answers[r] for r in range(self.world)]

    def close(self, *, force: bool = False, grace_s: float = 10.0) -> None:
        """Stop the ranks (politely unless ``force``), then kill what is left; idempotent."""
        if not force:
            for c in self.conns:
                try:
                    _send(c, ("stop", ()))
                except OSError:
                    pass
        for c in self.conns:
            c.close()
        self.conns = []
        deadline = time.monotonic() + (0 if force else grace_s)
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(force=exc[0] is not None)

    def __del__(self) -> None:  # pragma: no cover - the last resort of a caller that forgot close()
        if getattr(self, "procs", None):
            self.close(force=True)

    @property
    def policy(self) -> None:
        """The policy module lives in the ranks (train.mtp needs a one-process trainer)."""
        return None

    @property
    def step_logprobs(self) -> dict[int, torch.Tensor]:
        """The ranks keep the step's log-probs: none here."""
        return {}

    def adapter_state(self) -> None:
        """The ranks publish merged weights (``engine_state``)."""
        return None

    def base_state(self) -> dict[str, torch.Tensor]:
        return self.engine_state()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- the trainer's interface ------------------------------------------------------------------
    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        metrics = self._call("train_step", list(samples))[0]
        self.step = int(metrics.get("train/step", self.step))
        return metrics

    def engine_state(self) -> dict[str, torch.Tensor]:
        """The whole policy, for the engines: streamed one layer at a time or gathered at once
        (train.parallel.weight_sync)."""
        if self.cfg.parallel.weight_sync == "gather":
            return self.gather_state()
        state: dict[str, torch.Tensor] = {}
        self.stream_state(state.update)
        return state

    def gather_state(self) -> dict[str, torch.Tensor]:
        """All parameters gathered on rank 0 at once, sent whole."""
        return self._call("gather_state")[0]

    def stream_state(self, sink: Callable[[dict[str, torch.Tensor]], None]) -> int:
        """``sink`` gets the weights one chunk (a layer) at a time as rank 0 gathers them; returns the
        largest chunk's bytes (about what rank 0 held at once)."""
        for c in self.conns:
            _send(c, ("stream_state", ()))
        peak = 0
        try:
            while True:
                kind, value = self._recv_rank0()
                if kind == "end":
                    break
                peak = max(peak, sum(t.numel() * t.element_size() for t in value.values()))
                sink(value)
            self._collect(self.timeout_s)
        except BaseException:
            self.close(force=True)
            raise
        return peak

    def _recv_rank0(self) -> tuple[str, Any]:
        conn, deadline = self.conns[0], time.monotonic() + self.timeout_s
        while not conn.poll(0.2):
            for r, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RankError(f"rank {r} exited with code {p.returncode}")
            if time.monotonic() > deadline:
                raise RankError("rank 0 did not send the next weights chunk in time")
        try:
            kind, value = _recv(conn)
        except EOFError:
            raise RankError("rank 0 exited while streaming weights") from None
        if kind == "error":
            raise RankError(f"rank 0 failed:\n{value}")
        return kind, value

    def state_bytes(self) -> list[dict[str, int]]:
        """Per rank: bytes of parameters, gradients and optimiser state it holds."""
        return self._call("state_bytes")

    def save(self, path: str | Path, extra: dict[str, Any] | None = None, *, tokenizer: Any = None,
             also: Callable[[Path], None] | None = None) -> Path:
        """A sharded checkpoint (torch.distributed.checkpoint) that is also an HF directory; ``also(dir)``
        writes more into it."""
        self._call("save", str(path), extra or {}, tokenizer)
        if also is not None:
            also(Path(path))
        return Path(path)

    def load(self, path: str | Path) -> dict[str, Any]:
        from arborl.train.checkpoint import existing_checkpoint

        extra, self.step = self._call("load", str(existing_checkpoint(path)))[0]
        return extra

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(trainer, *args)`` on every rank (a picklable function); the answers in rank order."""
        return self._call("run", fn, *args)


# --------------------------------------------------------------------------- the rank process


def _handle(trainer: Any, conn: Connection, cmd: str, args: tuple) -> Any:
    from arborl.train import dist_checkpoint

    if cmd == "train_step":
        return trainer.train_step(args[0])
    if cmd == "gather_state":
        return dist_checkpoint.full_state(trainer)
    if cmd == "stream_state":
        for chunk in trainer.stream_state():
            if trainer.rank == 0:
                _send(conn, ("chunk", chunk))
            del chunk
        if trainer.rank == 0:
            _send(conn, ("end", None))
        return None
    if cmd == "state_bytes":
        return trainer.state_bytes()
    if cmd == "save":
        dist_checkpoint.save(args[0], trainer, args[1], tokenizer=args[2])
        return None
    if cmd == "load":
        return dist_checkpoint.load(args[0], trainer), trainer.step
    if cmd == "run":
        return args[0](trainer, *args[1:])
    raise ValueError(f"unknown rank command {cmd!r}")


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that started it dies (a killed trainer leaves no rank
    waiting in a collective)."""
    parent = os.environ.get(PARENT_ENV)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if parent and os.getppid() != int(parent):  # it died before the prctl
        os._exit(1)


def rank_main() -> None:
    """One rank: join the process group from torchrun's variables, build the trainer, serve commands."""
    import torch.distributed as dist

    from arborl.train.parallel import ShardedTrainer, default_backend

    if PARENT_ENV in os.environ:  # a child process of the driver (a Ray rank actor dies with its owner instead)
        _die_with_parent()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # split outputs, read only
    rank = int(os.environ["RANK"])
    host, port = os.environ[CONTROL_ENV].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    _send(conn, rank)
    trainer = None
    try:
        cmd, (model, cfg_data, temperature) = _recv(conn)
        assert cmd == "init"
        cfg = TrainConfig.model_validate(cfg_data)
        torch.set_num_threads(cfg.parallel.threads_per_rank)
        from datetime import timedelta

        backend = default_backend(cfg.parallel)
        if backend == "nccl":
            # a Ray rank actor sees only its own GPU (CUDA_VISIBLE_DEVICES): device 0 there
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=cfg.parallel.timeout_s))
        if not isinstance(model, nn.Module):
            model = model()
        if backend == "nccl":
            model = model.to(f"cuda:{torch.cuda.current_device()}")
        trainer = ShardedTrainer(model, cfg, temperature=temperature)
        _send(conn, ("ok", None))
        while True:
            try:
                cmd, args = _recv(conn)
            except EOFError:
                break
            if cmd == "stop":
                break
            _send(conn, ("ok", _handle(trainer, conn, cmd, args)))
    except BaseException:
        try:
            _send(conn, ("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


if __name__ == "__main__":
    rank_main()
