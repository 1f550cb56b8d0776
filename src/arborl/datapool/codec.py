"""Compact array <-> bytes encoding for the data pool.

Token ids and policy versions are stored as little-endian int32 (``'<i4'``), log-probabilities
as little-endian float32 (``'<f4'``): 4 bytes a token each, independent of the host's byte order.

float32 storage means log-probabilities read back as their float32-rounded values
(``float(np.float32(x))``), i.e. equal to what was written up to a relative error of about 6e-8.
Integers must fit in int32; anything else is refused rather than silently wrapped or truncated.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from arborl.types import InvalidRequestError

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
_I32_MIN, _I32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def encode_i32(values: Sequence[int], what: str = "array") -> bytes:
    """Integers -> little-endian int32 bytes; InvalidRequestError if any is not an int32 integer."""
    if len(values) == 0:
        return b""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} must be a flat list of integers: {e}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"{what} must be a flat list of integers (got dtype {arr.dtype}, shape {arr.shape})")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < _I32_MIN or hi > _I32_MAX:
        bad = lo if lo < _I32_MIN else hi
        raise InvalidRequestError(f"{what} holds {bad}, outside the int32 range the data pool stores")
    return arr.astype(I32).tobytes()


def decode_i32(data: bytes | None) -> list[int]:
    if not data:
        return []
    return np.frombuffer(data, dtype=I32).tolist()


def encode_f32(values: Sequence[float], what: str = "array") -> bytes:
    """Floats -> little-endian float32 bytes (values are rounded to float32)."""
    if len(values) == 0:
        return b""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} must be a flat list of numbers: {e}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "fiu":
        raise InvalidRequestError(f"{what} must be a flat list of numbers (got dtype {arr.dtype}, shape {arr.shape})")
    return arr.astype(F32).tobytes()


def decode_f32(data: bytes | None) -> list[float]:
    if not data:
        return []
    return np.frombuffer(data, dtype=F32).tolist()


def encode_json(value: Any, what: str = "value") -> str:
    """Canonical JSON text (sorted keys) so equal dicts encode to equal strings."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} is not JSON-serialisable: {e}") from None


def decode_json(text: str | None, default: Any) -> Any:
    if text is None or text == "":
        return default
    return json.loads(text)
