"""The engine pool: every engine request of the gateway is placed here, by one of two placements.

* **affinity** (``scheduling.dispatch=affinity``, the default): a request runs whole on one engine; a
  session's calls stay on its engine so its growing prompt finds its prefix in that engine's KV
  cache, and move to the least-loaded engine when that one is busy (``engine/affinity.py``).
* **dispatch** (any other ``scheduling.dispatch``: ``pinned``, ``seer``, your own): that dispatch policy
  of ``scheduling/dispatch.py`` serves every request from its queue, grouped by the session's GRPO
  group (Seer in pieces, migrating KV between engines; ``engine/dispatcher.py``).

The caller asks for a :class:`Lease` (an engine-shaped handle for one gateway request plus its
bookkeeping), and the trainer's weights reach every engine through :meth:`EnginePool.update_weights`,
which knows what the placement must do around a weight update (abort-and-resume partial rollout).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from arborl.config import SchedulingConfig
from arborl.config.scheduling import AFFINITY
from arborl.engine.affinity import AffinityRouter
from arborl.engine.dispatcher import Dispatcher
from arborl.engine.face import EngineFace, RequestFace
from arborl.scheduling.dispatch import make_dispatch


@dataclass
class Lease:
    """Where one gateway request (``n`` engine requests) runs. ``index`` is the engine's index under
    affinity placement (the session remembers it), None under dispatch. ``release`` once the request
    ended; ``lost`` when the engine turned out to be shut down."""

    engine: RequestFace
    how: str  # affinity | new | fallback | dispatch
    index: int | None
    pool: "EnginePool"
    n: int

    def release(self) -> None:
        if self.index is not None:
            self.pool.router.routed(self.index, -self.n)

    def lost(self) -> None:
        if self.index is not None:
            self.pool.router.mark_down(self.index)


class EnginePool:
    """Engines serving one policy, and the placement of every request over them."""

    def __init__(self, engines: Sequence[EngineFace], *, affinity_max_load: int = 8,
                 dispatcher: Dispatcher | None = None, abort_resume: bool = False) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self.router = AffinityRouter(self.engines, affinity_max_load)
        self.dispatcher = dispatcher  # when set, it places every request (pieces through a dispatch policy)
        self.abort_resume = abort_resume and dispatcher is not None

    @classmethod
    def from_config(cls, engines: Sequence[EngineFace], sched: SchedulingConfig, *, affinity_max_load: int = 8) -> "EnginePool":
        """Affinity placement for ``scheduling.dispatch=affinity``, else the dispatcher with that dispatch
        policy (abort-and-resume partial rollout needs one: the config refuses it with affinity)."""
        dispatcher = None
        if sched.dispatch != AFFINITY:
            dispatcher = Dispatcher(engines, make_dispatch(sched, len(engines)), migration=sched.migration)
        return cls(engines, affinity_max_load=affinity_max_load, dispatcher=dispatcher,
                   abort_resume=sched.partial_rollout == "abort_resume")

    # -- what the gateway needs to know ------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        return min(e.limits.max_seq_len for e in self.engines)

    @property
    def vocab_size(self) -> int:
        return self.engines[0].limits.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.engines[0].limits.eos_token_ids)

    @property
    def version(self) -> int:
        return max(e.version for e in self.engines)

    # -- placing requests --------------------------------------------------------------------------
    def lease(self, *, session_id: str, group_id: str, current: int | None, n: int) -> Lease:
        """Place a gateway request of ``n`` engine requests for a session (whose engine so far is
        ``current``) of GRPO group ``group_id``. Raises EngineClosedError when no engine serves."""
        if self.dispatcher is not None:
            return Lease(self.dispatcher.front(group_id or session_id), "dispatch", None, self, n)
        idx, how = self.router.pick(current)
        self.router.routed(idx, n)
        return Lease(self.engines[idx], how, idx, self, n)

    # -- weights -----------------------------------------------------------------------------------
    async def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load ``state`` into every engine as policy ``version``. Under abort-and-resume partial
        rollout the pieces in flight stop first and resume under the new weights; otherwise they
        continue and their later tokens carry the new version."""
        ctx = self.dispatcher.updating(abort_resume=self.abort_resume) if self.dispatcher else contextlib.nullcontext()
        async with ctx:
            await asyncio.gather(*(e.update_weights(state, version) for e in self.engines))

    @property
    def serves_adapters(self) -> bool:
        """Whether every engine loads published LoRA adapters itself (``serves_adapters``; arborl's in-process
        engine), so a LoRA trainer may publish its adapters alone once the base is there."""
        return bool(self.engines) and all(getattr(e, "serves_adapters", False) for e in self.engines)

    async def release_memory(self, weights: bool = False) -> int:
        """Every idle engine frees its prefix cache and spare KV rows, and with ``weights`` its own copy of
        the weights until the next update (``EngineFace.release_memory``); the bytes freed in this process."""
        # an engine is asked for its weights only when they may go (an older EngineFace takes no argument)
        calls = (e.release_memory(weights=True) if weights else e.release_memory() for e in self.engines)
        return sum(await asyncio.gather(*calls))

    # -- observing ---------------------------------------------------------------------------------
    def engine_rows(self) -> list[dict[str, Any]]:
        return [{"engine_id": e.engine_id, "load": self.router.load(i), "version": e.version, "down": i in self.router.down,
                 **e.spec_stats()} for i, e in enumerate(self.engines)]

    def spec_stats(self) -> dict[str, float]:
        """Speculative decoding over every engine (counters summed); empty when it is off."""
        from arborl.engine.specdec.metrics import combine
        return combine([e.spec_stats() for e in self.engines])

    def dispatch_stats(self) -> dict[str, float]:
        """The dispatcher's counters (pieces, migrations, resumed, ...); empty under affinity placement."""
        return self.dispatcher.stats() if self.dispatcher is not None else {}

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()

