"""Speculative decoding: drafters (registry ``DRAFTERS``), lossless verification, adaptive draft
length and metrics. Importing the package registers the built-in drafters."""

from arborl.engine.specdec import draft_model as _draft_model  # noqa: F401  (registers "draft_model")
from arborl.engine.specdec import mtp as _mtp  # noqa: F401  (registers "mtp")
from arborl.engine.specdec import suffix as _suffix  # noqa: F401  (registers "suffix")
from arborl.engine.specdec.decoder import SpecDecoder
from arborl.engine.specdec.draft import Draft
from arborl.engine.specdec.drafter import DRAFTERS, Drafter

__all__ = ["DRAFTERS", "Draft", "Drafter", "SpecDecoder"]
