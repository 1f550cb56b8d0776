"""What a training step will hold in memory, estimated before it runs, and the error when it cannot fit.

    need = weights + gradients + optimizer state                  (counted from the parameters)
         + activations/token x the largest micro-batch's tokens   (measured: one probe forward)
         + logits: rows x vocabulary x 4 bytes x 3                (chunk rows, or every row when
                                                                   train.logits_chunk_tokens = 0:
                                                                   logits, softmax, their gradient)

The activations per token are measured, not guessed: one forward of a short probe sequence under
``torch.autograd.graph.saved_tensors_hooks`` adds up the distinct tensors autograd keeps for the
backward (parameters excluded), with this trainer's own settings (activation checkpointing, attention
backend, dtype), plus one decoder layer's worth for the backward's transient (its recomputation under
checkpointing, its gradients otherwise). It is a lower bound: the backward's other transients (the
activations' gradients, attention's probabilities) and the C heap's fragmentation are not in it -- on
SmolLM2 (``arborl bench memory``) a LoRA step of 4096-token micro-batches under checkpointing peaked
about 4 GB above it -- so a step it says cannot fit cannot, and one near the limit may still not. The limit is ``train.memory_limit_gb``, or the device's memory
(the CUDA device's, or the machine's or container's RAM on the CPU) less what the process already holds
besides the trainer (the engine's weights and KV cache where they share the process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from arborl.types import InvalidRequestError

GB = 1e9
PROBE_TOKENS = 64
LOGITS_COPIES = 3  # a chunk's logits, their softmax and their gradient exist together in the backward


class TrainMemoryError(InvalidRequestError):
    """A configured training step cannot fit in the memory it may use."""


@dataclass(frozen=True)
class StepMemory:
    """Bytes a training step needs, by component (``tokens``: the largest micro-batch's packed tokens)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    def table(self) -> str:
        parts = [("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                 (f"activations of {self.tokens} tokens", self.activations), ("logits", self.logits)]
        return ", ".join(f"{name} {readable(b)}" for name, b in parts)


def readable(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def _unique(params) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def activation_bytes_per_token(forward, policy: nn.Module, layers: int) -> float:
    """Bytes autograd keeps per token for the backward of ``forward(batch)`` (a packed batch of one probe
    sequence), plus one layer's worth of transient; parameters and the probe's inputs are not counted."""
    from arborl.train.packing import pack

    params = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    vocab = policy.get_input_embeddings().weight.shape[0]
    probe = pack([[(7 * i + 1) % vocab for i in range(PROBE_TOKENS)]], mode="flat")
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = forward(probe)
    del out
    saved = sum(kept.values()) / PROBE_TOKENS
    return saved * (1 + 1 / max(layers, 1))


def step_memory(trainer, tokens: int, activation_per_token: float) -> StepMemory:
    """The estimate for a micro-batch of ``tokens`` packed tokens under ``trainer`` (its config, its
    parameters, its optimizer: AdamW keeps two moments per trainable value)."""
    cfg = trainer.cfg
    every = _unique(list(trainer.model.parameters()) + (list(trainer.ref_model.parameters())
                                                         if trainer.ref_model is not None else []))
    trainable = _unique(trainer.params)
    vocab = trainer.policy.get_input_embeddings().weight.shape[0]
    rows = tokens if cfg.logits_chunk_tokens <= 0 else min(cfg.logits_chunk_tokens, tokens)
    return StepMemory(
        weights=_local_bytes(every),
        gradients=_local_bytes(trainable),
        optimizer=2 * _local_bytes(trainable),
        activations=int(activation_per_token * tokens),
        logits=rows * vocab * 4 * LOGITS_COPIES,
        tokens=tokens,
    )


def _local_bytes(params) -> int:
    """Bytes of ``params`` this process holds (a sharded parameter: its local shard)."""
    return sum(t.numel() * t.element_size() for t in (p.to_local() if hasattr(p, "to_local") else p for p in params))


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def _resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_budget(device: torch.device, held: int) -> tuple[int, str]:
    """The bytes a step may use when train.memory_limit_gb is unset, and a phrase saying where it comes from;
    ``held``: what of the step's need the trainer already holds (weights, gradients, optimizer state)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        others = max(torch.cuda.memory_allocated(device) - held, 0)
        return total - others, f"the GPU's {readable(total)} less {readable(others)} held by the rest of the process"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    if limit is not None:
        total = min(total, limit)
    others = max(_resident_bytes() - held, 0)
    return total - others, (f"the machine's {readable(total)} less {readable(others)} held by the rest of the process "
                            "(engine, KV cache, libraries)")


def held_bytes(trainer) -> int:
    """What of a step's need the trainer holds now: its weights, the gradients and optimizer state that exist."""
    grads = [p.grad for p in _unique(trainer.params) if p.grad is not None]
    state = [t for st in trainer.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    weights = _unique(list(trainer.model.parameters()) + (list(trainer.ref_model.parameters())
                                                          if trainer.ref_model is not None else []))
    return _local_bytes(weights) + _local_bytes(grads) + _local_bytes(state)


def check_fits(need: StepMemory, limit_gb: float | None, device: torch.device, *, held: int,
               checkpointing: bool | int) -> None:
    """Raise :class:`TrainMemoryError`, naming the knob to lower, when ``need`` exceeds the budget:
    ``limit_gb``, or (None) the device's memory less what the process holds besides ``held`` (the
    trainer's share of it). ``checkpointing``: the forward's (TrainConfig.checkpoint_layers): True, every layer
    (not advised then), or how many layers are."""
    if limit_gb is not None:
        budget, where = int(limit_gb * GB), f"train.memory_limit_gb = {limit_gb:g}"
    else:
        budget, where = device_budget(device, held)
    if need.total <= budget:
        return
    dynamic = {"activations": need.activations, "logits": need.logits}
    static = need.weights + need.gradients + need.optimizer
    if static > budget:
        advice = ("the weights, gradients and optimizer state alone exceed it: train LoRA adapters (train.lora_rank) "
                  "or load the model in bfloat16 (model.dtype)")
    elif max(dynamic, key=dynamic.get) == "logits":
        advice = "lower train.logits_chunk_tokens (logits of fewer positions at once; 0 means every position's)"
    else:
        if checkpointing is True:
            more = ""
        elif checkpointing:
            more = (f", or checkpoint more of the decoder's layers (train.activation_checkpointing_layers, now "
                    f"{int(checkpointing)}; unset = every layer)")
        else:
            more = ", or set train.activation_checkpointing=true (a layer's activations at a time)"
        advice = "lower train.micro_batch_tokens (fewer tokens per forward)" + more
    raise TrainMemoryError(
        f"a training step needs at least {readable(need.total)} ({need.table()}) but may use {readable(budget)} "
        f"({where}): {advice}"
    )
