"""The drafter protocol and its registry (``engine.spec.drafter``).

A drafter sees every running sequence's tokens (``sync``, called before each decode step and when a
sequence leaves) and proposes at most ``k`` tokens deep for each (``propose``). Drafts only decide
how much one verify forward can accept: the tokens and their log-probs always come from the policy.
"""

from __future__ import annotations

from typing import Callable, Protocol

from torch import nn

from arborl.config import EngineConfig
from arborl.engine.model_runner import ModelRunner
from arborl.engine.sequence import Sequence
from arborl.engine.specdec.draft import Draft
from arborl.registry import Registry


class EngineView(Protocol):
    """What drafters and the spec decoder see of the engine (``LLMEngine``)."""

    config: EngineConfig
    model: nn.Module
    runner: ModelRunner
    eos_token_ids: set[int]


class Drafter(Protocol):
    def sync(self, seq: Sequence) -> None:
        """Take in the tokens of ``seq`` (prompt and output) it has not seen yet."""

    def propose(self, seqs: list[Sequence], k: int) -> list[Draft]:
        """One draft (possibly empty) per sequence, at most ``k`` tokens deep."""

    def release(self, seq: Sequence) -> None:
        """``seq`` left the running batch (finished, aborted)."""

    def weights_updated(self) -> None:
        """The policy changed (drafters derived from it refresh)."""

    # optional: ``observe(seq, rows)`` takes the policy's hidden rows [m, hidden] that produced the last
    # m tokens of ``seq`` after each step; ``load_head(state)`` takes published ``mtp.*`` tensors


# an entry: f(engine) -> Drafter; the engine gives the config (engine.config.spec), runner and model
DRAFTERS: Registry[Callable[[EngineView], Drafter]] = Registry("drafter")
