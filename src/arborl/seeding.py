"""Seeds derived from names: one hash for every seed arborl derives (episodes, task draws, the
simulator's requests), so a resumed run or a replay draws exactly what the original did."""

from __future__ import annotations

import hashlib
from typing import Any


def derive_seed(*parts: Any, bits: int = 62) -> int:
    """A seed in [0, 2**bits) from the parts' string forms, stable across processes and platforms."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**bits - 1)
