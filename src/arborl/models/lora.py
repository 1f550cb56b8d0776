"""LoRA adapters as the engines receive them: one merge rule for the trainer and the engine.

A published adapter of the Linear module ``name`` is three tensors under the plain model's names:
``{name}.lora_A`` [rank, in], ``{name}.lora_B`` [out, rank] and ``{name}.lora_scale`` (0-dim, alpha /
rank). The module computes ``x @ W.T + scale * (x @ A.T) @ B.T``; merged into the weight that is
``W + scale * (B @ A)``, peft's ``get_delta_weight`` for a plain (not fan-in-fan-out) Linear. The trainer
merges with ``merge`` when it publishes full weights, so the published adapters merged with it give the
full sync's weights bit for bit; an engine serving them adds ``apply``'s term instead (equal within
float32 rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from arborl.types import ArborlError

SUFFIXES = (".lora_A", ".lora_B", ".lora_scale")


class Adapter(NamedTuple):
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scale: float

    def delta(self) -> torch.Tensor:
        """``scale * (B @ A)``: what the adapter adds to the weight [out, in]."""
        return (self.b @ self.a) * self.scale

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapter adds to the module's output for rows ``x`` [..., in]."""
        return (x @ self.a.T) @ self.b.T * self.scale


def merge(weight: torch.Tensor, adapter: Adapter) -> torch.Tensor:
    """The weight with the adapter merged in (a new tensor; ``weight`` stays)."""
    return weight + adapter.delta().to(weight.dtype)


def is_adapter_key(key: str) -> bool:
    return key.endswith(SUFFIXES)


def adapter_entries(name: str, adapter: Adapter) -> dict[str, torch.Tensor]:
    """The three published tensors of module ``name``'s adapter."""
    return {f"{name}.lora_A": adapter.a, f"{name}.lora_B": adapter.b,
            f"{name}.lora_scale": torch.tensor(float(adapter.scale), dtype=torch.float64)}


def split_adapters(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Adapter]]:
    """``state`` without its adapter entries, and the adapters by module name. Raises ArborlError on an
    incomplete or mis-shaped adapter."""
    rest = {k: v for k, v in state.items() if not is_adapter_key(k)}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if is_adapter_key(key):
            name, _, part = key.rpartition(".")
            parts.setdefault(name, {})[part] = value
    adapters: dict[str, Adapter] = {}
    for name, p in parts.items():
        missing = [s.lstrip(".") for s in SUFFIXES if s.lstrip(".") not in p]
        if missing:
            raise ArborlError(f"update_weights: the adapter of {name} lacks {', '.join(missing)} (an adapter is "
                              "published as lora_A, lora_B and lora_scale together)")
        a, b = p["lora_A"], p["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ArborlError(f"update_weights: the adapter of {name} has lora_A {tuple(a.shape)} and lora_B "
                              f"{tuple(b.shape)}; expected [rank, in] and [out, rank]")
        adapters[name] = Adapter(a, b, float(p["lora_scale"]))
    return rest, adapters
