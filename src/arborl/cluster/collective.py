"""Weight sync by collective broadcast (``cluster.weight_sync=collective``): the driver (rank 0, where
the trainer is) and every live engine actor form one torch.distributed process group -- NCCL when
the engines are on GPUs, gloo on CPU -- and each version goes out as one broadcast per dtype of a
flat buffer. Nothing passes through the object store or a file.

The group is the driver plus the engine actors that are up; it is formed again (a new store prefix,
a new epoch) whenever that set changes, e.g. after Ray restarted an actor. An actor that comes back
between two versions loads the latest one through the object store (``for_restart``); a broadcast
that fails (an actor died during it) falls back to the object store for that version.

A process group object is built directly on a TCP store (``ProcessGroupGloo`` / ``ProcessGroupNCCL``),
so the driver's default ``torch.distributed`` group stays free for the trainer.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where each tensor lies in the flat buffers: (name, dtype, shape, offset in its dtype's buffer)."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    sizes: tuple[tuple[str, int], ...]  # elements per dtype buffer

    @staticmethod
    def of(state: dict[str, torch.Tensor]) -> "Layout":
        entries, sizes = [], {}
        for k, v in state.items():
            dt = str(v.dtype).removeprefix("torch.")
            entries.append((k, dt, tuple(v.shape), sizes.get(dt, 0)))
            sizes[dt] = sizes.get(dt, 0) + v.numel()
        return Layout(tuple(entries), tuple(sizes.items()))

    def flatten(self, state: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
        by_dtype: dict[str, list[torch.Tensor]] = {}
        for k, dt, _, _ in self.entries:
            by_dtype.setdefault(dt, []).append(state[k].detach().reshape(-1))
        return {dt: torch.cat(ts).to(device) for dt, ts in by_dtype.items()}

    def empty(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        return {dt: torch.empty(n, dtype=getattr(torch, dt), device=device) for dt, n in self.sizes}

    def unflatten(self, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: flat[dt][off:off + _numel(shape)].view(shape) for k, dt, shape, off in self.entries}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class MissedBroadcast(RuntimeError):
    """An actor was asked to load a version it was not in the broadcast of (it rejoined just after);
    its handle then sends the object-store copy."""


@dataclass(frozen=True)
class CollectivePayload:
    """What ``update_weights`` receives: the version an actor already holds from the broadcast, or
    (``ref``) the state through the object store, for an actor that was not in the broadcast."""

    version: int
    ref: Any = None


def process_group(backend: str, host: str, port: int, epoch: int, rank: int, world: int, timeout_s: float,
                  store: Any = None) -> Any:
    """One member's process group of ``epoch`` (blocks until all ``world`` members joined)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, None, False, timeout=timeout)
    prefixed = dist.PrefixStore(f"arborl-weights-{epoch}/", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world, timeout=timeout)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def broadcast(pg: Any, flat: dict[str, torch.Tensor]) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for dt in sorted(flat):
        pg.broadcast([flat[dt]], opts).wait()


class ActorSide:
    """The engine actor's end: joins a group, receives a version into fresh buffers, hands it over."""

    def __init__(self) -> None:
        self.pg: Any = None
        self.epoch = -1
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, state)
        self.backend = "gloo"

    def join(self, backend: str, host: str, port: int, epoch: int, rank: int, world: int, timeout_s: float) -> None:
        self.pg = None  # the previous group's members are gone or re-forming
        self.pg = process_group(backend, host, port, epoch, rank, world, timeout_s)
        self.epoch, self.backend = epoch, backend

    def receive(self, epoch: int, version: int, layout: Layout, device: str) -> None:
        if epoch != self.epoch or self.pg is None:
            raise RuntimeError(f"weight broadcast of group {epoch}, but this actor is in group {self.epoch}")
        flat = layout.empty(device if self.backend == "nccl" else "cpu")  # gloo: host buffers
        broadcast(self.pg, flat)
        self.staged = (version, layout.unflatten(flat))

    def holds(self, version: int) -> bool:
        return self.staged is not None and self.staged[0] == version

    def take(self, payload: CollectivePayload, fetched: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The broadcast copy of ``payload.version``, else ``fetched`` (its object-store copy, loaded)."""
        if self.holds(payload.version):
            assert self.staged is not None
            state, self.staged = self.staged[1], None
            return state
        if fetched is None:
            raise MissedBroadcast(f"version {payload.version} was not broadcast to this actor and came without a copy")
        return fetched


def choose_backend(engines: list) -> str:
    """NCCL when the engines are on GPUs and every rank (the driver's GPU, each engine's) has a GPU of
    its own -- NCCL refuses two ranks on one device; gloo otherwise (GPU tensors go through host
    buffers)."""
    import os

    if not engines or not all(str(getattr(e, "device", "cpu")).startswith("cuda") for e in engines):
        return "gloo"
    if not torch.cuda.is_available():
        return "gloo"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = visible.split(",")[torch.cuda.current_device()] if visible else str(torch.cuda.current_device())
    seen = {mine.strip()}
    for e in engines:
        ids = [str(i) for i in getattr(e, "gpu_ids", [])]
        if len(ids) != 1 or ids[0] in seen:
            return "gloo"
        seen.add(ids[0])
    return "nccl"


@dataclass
class CollectiveSync:
    """``WeightSync`` by broadcast; ``attach`` gives it the deployment's engine handles."""

    name: str = "collective"
    timeout_s: float = 120.0
    engines: list = field(default_factory=list)
    backend: str = "gloo"
    _store: Any = None
    _pg: Any = None
    _members: tuple = ()
    _epoch: int = 0
    _latest: tuple[dict[str, torch.Tensor], int] | None = None  # for an actor that restarts
    _lock: threading.Lock = field(default_factory=threading.Lock)
    fallbacks: int = 0  # versions that went through the object store instead (a broadcast failed)
    groups_formed: int = 0

    def attach(self, engines: list, *, backend: str | None = None) -> None:
        self.engines = list(engines)
        self.backend = backend or choose_backend(engines)

    def _form(self, live: list) -> None:
        import ray
        import torch.distributed as dist

        if self._store is None:
            host = ray.util.get_node_ip_address()
            self._store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                                        wait_for_workers=False)
            self._host = host
        self._pg, self._members = None, ()
        self._epoch += 1
        world = len(live) + 1
        refs = [e.actor.join_collective.remote(self.backend, self._host, self._store.port, self._epoch, r + 1, world,
                                               self.timeout_s) for r, e in enumerate(live)]
        pg = process_group(self.backend, self._host, self._store.port, self._epoch, 0, world, self.timeout_s,
                           store=self._store)
        ray.get(refs, timeout=self.timeout_s)
        self._pg, self._members = pg, tuple((e, e.incarnation) for e in live)
        self.groups_formed += 1

    def publish(self, state: dict[str, torch.Tensor], version: int) -> CollectivePayload:
        import ray

        with self._lock:
            self._latest = (state, version)
            live = [e for e in self.engines if not e.closed]
            if not live:
                return CollectivePayload(version)
            layout = Layout.of(state)
            try:
                if tuple((e, e.incarnation) for e in live) != self._members:
                    self._form(live)
                device = "cuda" if self.backend == "nccl" else "cpu"
                flat = layout.flatten(state, device)
                refs = [e.actor.receive_weights.remote(self._epoch, version, layout) for e in live]
                broadcast(self._pg, flat)
                ray.get(refs, timeout=self.timeout_s)
                return CollectivePayload(version)
            except Exception as e:  # noqa: BLE001 - an actor died mid-broadcast: this version goes the other way
                log.warning("weight broadcast of version %d failed (%r); it goes through the object store", version, e)
                self._pg, self._members = None, ()
                self.fallbacks += 1
                return self.for_restart()

    def for_restart(self) -> CollectivePayload | None:
        """The latest version through the object store (an actor that was not in its broadcast)."""
        if self._latest is None:
            return None
        import ray

        state, version = self._latest
        return CollectivePayload(version, ray.put({k: v.detach().cpu().contiguous().numpy() for k, v in state.items()}))

    def retire(self, payload: Any) -> None:
        pass

    def close(self) -> None:
        self._pg, self._members, self._latest = None, (), None
        self._store = None
