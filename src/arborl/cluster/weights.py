"""Weight sync trainer -> engine actors, one published copy per policy version.

The engine pool hands every engine the same state dict; the :class:`WeightPublisher` they share
publishes it once per version (``ray.put`` of the tensors, or one safetensors file on shared
storage) and every actor reads that one copy. The latest payload is kept so an engine actor that
Ray restarted loads the current weights before it serves again.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from arborl.registry import Registry


class WeightSync(Protocol):
    """How a version's weights travel: ``publish`` runs once in the driver and returns a payload an
    actor method receives; ``load`` runs in the actor and turns that payload into tensors."""

    name: str

    def publish(self, state: dict[str, torch.Tensor], version: int) -> Any: ...

    def retire(self, payload: Any) -> None: ...


class ObjectStoreSync:
    """One ``ray.put`` per version; passed as a top-level argument, Ray resolves it in each actor from
    the node's shared-memory object store (zero-copy numpy views, copied into the parameters)."""

    name = "object_store"

    def publish(self, state: dict[str, torch.Tensor], version: int) -> Any:
        import ray

        return ray.put({k: v.detach().cpu().contiguous().numpy() for k, v in state.items()})

    def retire(self, payload: Any) -> None:  # the object store frees it once no reference is left
        pass


class SafetensorsSync:
    """One safetensors file per version in a directory every node sees; the payload is its path."""

    name = "safetensors"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def publish(self, state: dict[str, torch.Tensor], version: int) -> Any:
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"policy-v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        # safetensors refuses tensors that share memory (tied embeddings): one clone each
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(tmp))
        tmp.replace(path)  # a reader never sees half a file
        return str(path)

    def retire(self, payload: Any) -> None:
        Path(payload).unlink(missing_ok=True)


WEIGHT_SYNC: Registry = Registry("cluster.weight_sync")
WEIGHT_SYNC.register("object_store")(lambda directory: ObjectStoreSync())
WEIGHT_SYNC.register("safetensors")(lambda directory: SafetensorsSync(directory))


@WEIGHT_SYNC.register("collective")
def _collective(directory: str | Path) -> Any:
    from arborl.cluster.collective import CollectiveSync

    return CollectiveSync()


def load_payload(payload: Any) -> dict[str, torch.Tensor]:
    """Actor side: a published payload as tensors (what ``LLMEngine.update_weights`` loads)."""
    if isinstance(payload, str):
        from safetensors.torch import load_file

        return load_file(payload)
    with warnings.catch_warnings():  # read-only views of the object store: only read (copied into the parameters)
        warnings.simplefilter("ignore", UserWarning)
        return {k: torch.from_numpy(v) for k, v in payload.items()}


class WeightPublisher:
    """Shared by the engine proxies of one deployment: publishes a state once per version and keeps
    the latest payload (for an actor that restarts)."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self.latest: tuple[Any, int] | None = None  # (payload, version); None = the initial weights
        self.publish_s: list[float] = []
        self._sync_of_latest: WeightSync = sync

    def payload(self, state: dict[str, torch.Tensor], version: int) -> Any:
        key = (id(state), version)
        with self._lock:
            if self._key == key and self.latest is not None:
                return self.latest[0]
            t0 = time.perf_counter()
            sync = self.sync
            payload = sync.publish(state, version)
            self.publish_s.append(time.perf_counter() - t0)
            old, self._key, self.latest = self.latest, key, (payload, version)
            old_sync, self._sync_of_latest = self._sync_of_latest, sync
        if old is not None:
            old_sync.retire(old[0])  # by the method that published it
        return payload

    def for_restart(self) -> tuple[Any, int] | None:
        """The latest (payload, version) as an actor that was not there when it came out loads it (a
        broadcast is over by then: the collective method hands a copy through the object store)."""
        latest = self.latest
        if latest is None:
            return None
        make = getattr(self._sync_of_latest, "for_restart", None)
        payload = make() if make is not None else None
        return (payload, payload.version) if payload is not None else latest

    def close(self) -> None:
        close = getattr(self.sync, "close", None)
        if close is not None:
            close()
        if self.latest is not None:
            self._sync_of_latest.retire(self.latest[0])
            self.latest = None
