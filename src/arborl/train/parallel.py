"""Data-parallel training over N ranks (torch.distributed: DDP or FSDP2), with tree packing kept.

Every rank receives the whole batch and computes the same plan from it, so no rank waits for a
plan and the loss normalisers are global without a collective:

    parts  = minibatch_split(batch)                        # the optimiser steps, as in one process
    shares = balanced_split(part, ranks)                   # whole groups (prefix trees) per rank,
                                                           #   balanced by the tokens their tree computes
    each rank:  for its micro-batches of shares[rank]:
                    loss_r = sum over its samples / N_part # N_part = the PART's loss tokens (token_mean)
                    loss_r.backward()                      #   or samples (seq_mean, constant)
                gradients SUMMED over the ranks            # FSDP2 reduce-scatter / DDP all-reduce, no average
                clip (global norm), AdamW on the local shard

so the sum over ranks of the local gradients is the one process's gradient of the same batch
(``tests/test_parallel_exact.py``: 1 vs 2 ranks to 1e-5 in float32). Ranks whose share has fewer
micro-batches run idle ones (a zero-weighted forward and backward) so every rank joins the same
collectives. Aggregations whose value depends on how the batch is cut are refused
(:func:`check_supported`).

FSDP2 shards with ``fully_shard``: one unit per decoder layer plus the root (embeddings, final
norm, LM head). arborl's forward (``models/forward.py``) calls a layer's submodules, not the
layer, so each layer (and the root) is made call-through: ``layer(fn, *args)`` runs ``fn(*args)``
inside the layer's ``__call__``, where FSDP2 gathers its parameters and frees them after. Ranks
on one host under gloo gather and reduce-scatter through shared memory (``host_collectives.py``)
instead of gloo's TCP loopback.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from arborl.config import ParallelConfig, TrainConfig
from arborl.models.forward import make_call_through
from arborl.prefix import RadixTree
from arborl.train.host_collectives import host_comms
from arborl.train.packing import pack, packed_logprobs
from arborl.train.trainer import StepPlan, Trainer, _merge_metrics, micro_batches
from arborl.types import InvalidRequestError, Sample

# --------------------------------------------------------------------------- the split


def group_units(samples: list[Sample]) -> list[list[int]]:
    """Indices of ``samples`` by group (a GRPO group and its shared prompt: one prefix tree), in order
    of first appearance."""
    units: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        units.setdefault(s.group_id, []).append(i)
    return list(units.values())


def unit_tokens(samples: list[Sample], unit: list[int], *, tree: bool = True) -> int:
    """Tokens a unit's forward computes: its prefix tree's distinct tokens (``tree``) or the flat sum."""
    if not tree:
        return sum(len(samples[i].token_ids) for i in unit)
    prefixes: RadixTree[None] = RadixTree()
    for i in unit:
        prefixes.insert(samples[i].token_ids)
    return prefixes.total_tokens


def balanced_split(samples: list[Sample], ranks: int, *, tree: bool = True) -> list[list[int]]:
    """Indices of ``samples`` per rank: whole groups (prefix trees) only, balanced by the tokens each
    group's tree computes (flat tokens with ``tree=False``). Longest-processing-time first, as verl's
    ``balance_batch`` on tree tokens: the largest group goes to the least loaded rank, then the next;
    the most loaded rank then exceeds the least loaded by at most one group. Deterministic (every
    rank computes the same split); a rank gets nothing when there are fewer groups than ranks."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    units = group_units(samples)
    weights = [unit_tokens(samples, u, tree=tree) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-weights[u], u))
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for u in order:
        r = min(range(ranks), key=lambda k: (loads[k], k))
        loads[r] += weights[u]
        shares[r].extend(units[u])
    return [sorted(s) for s in shares]


# --------------------------------------------------------------------------- what runs exactly


def check_supported(cfg: TrainConfig) -> None:
    """Refuse, with what to change, the settings whose update is not the one process's on N ranks."""
    par = cfg.parallel
    if par.strategy == "none":
        return
    if cfg.lora_rank > 0:
        raise InvalidRequestError(
            "train.parallel.strategy ddp/fsdp2 trains the full model: set train.lora_rank=0 (or parallel.strategy=none)"
        )
    if cfg.mtp.enabled:
        raise InvalidRequestError("train.mtp.enabled trains the MTP head in one process: set train.mtp.enabled=false "
                                  "with train.parallel")
    if cfg.loss.aggregation == "constant" and cfg.loss.constant_normalizer is None:
        raise InvalidRequestError(
            "train.loss.aggregation=constant on several ranks needs train.loss.constant_normalizer (the default, the "
            "padded length, differs between the ranks' micro-batches)"
        )
    if cfg.loss.kind in ("clip_cov", "kl_cov"):
        raise InvalidRequestError(
            f"train.loss.kind={cfg.loss.kind} picks its tokens per micro-batch, which differ between ranks: use another "
            "kind with train.parallel, or parallel.strategy=none"
        )
    if par.strategy == "ddp" and (par.mixed_precision != "none" or par.cpu_offload):
        raise InvalidRequestError(
            "train.parallel.mixed_precision and cpu_offload are fsdp2 options: set parallel.strategy=fsdp2"
        )


def default_backend(par: ParallelConfig) -> str:
    if par.backend != "auto":
        return par.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


# --------------------------------------------------------------------------- wrapping


def _dtype(name: str) -> torch.dtype | None:
    return {"none": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def shard_model(model: nn.Module, par: ParallelConfig) -> nn.Module:
    """Wrap ``model`` for ``par.strategy`` in the current process group; returns the module to call
    (``root(fn, *args)`` runs ``fn(*args)`` with the strategy's hooks around it)."""
    if par.strategy == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=_dtype(par.mixed_precision), reduce_dtype=torch.float32
                                  if par.mixed_precision != "none" else None)
        offload = CPUOffloadPolicy() if par.cpu_offload else OffloadPolicy()
        comms = host_comms(model)  # gloo on one host: shared memory instead of TCP loopback
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=par.reshard_after_forward, mp_policy=mp, offload_policy=offload)
            make_call_through(layer)
        fully_shard(model, reshard_after_forward=par.reshard_after_forward, mp_policy=mp, offload_policy=offload)
        make_call_through(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum over the ranks: the loss is already normalised globally
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
                if comms is not None:
                    m.set_custom_all_gather(comms[0])
                    m.set_custom_reduce_scatter(comms[1])
        return model
    if par.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        make_call_through(model)
        device_ids = [model.device.index] if next(model.parameters()).is_cuda else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        ddp.register_comm_hook(None, _sum_hook)
        return ddp
    return make_call_through(model)


def _sum_hook(_state, bucket):
    """DDP communication hook: all-reduce SUM (DDP's default averages)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --------------------------------------------------------------------------- the rank's trainer


class ShardedTrainer(Trainer):
    """The trainer of one rank (the process group is initialised): whole batch in, its share trained;
    metrics merged over the ranks, so every rank returns the same dict."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, *, temperature: float = 1.0) -> None:
        check_supported(cfg)
        if not dist.is_initialized():
            raise InvalidRequestError("ShardedTrainer runs inside a torch.distributed process group (arborl.train.ranks)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.par = cfg.parallel
        # the KL reference (replicated on every rank) from the start weights, before sharding
        self._ref_source = copy.deepcopy(model).eval().requires_grad_(False) if cfg.loss.kl_coef > 0 else None
        self.root = shard_model(model, cfg.parallel)
        super().__init__(model, cfg, temperature=temperature)

    def _make_ref(self, model: nn.Module) -> nn.Module:
        return self._ref_source

    def check_memory(self, tokens: int) -> None:
        """Not estimated on the ranks: the probe forward would run outside the sharded root's collectives."""
        return None

    def _forward(self, batch, *, with_entropy: bool = False):
        return self.root(packed_logprobs, self.policy, batch, with_entropy=with_entropy, temperature=self.temperature,
                         checkpoint=self.cfg.checkpoint_layers, logits_chunk=self.cfg.logits_chunk_tokens)

    # -- the plan every rank computes -------------------------------------------------------------
    def _plan(self, samples: list[Sample], rows: list[int]) -> StepPlan:
        """This rank's micro-batches of the samples ``rows`` (its balanced share), packed; the slots are the
        most micro-batches any rank has (every rank sizes every share, packs only its own)."""
        tree = self.cfg.packing != "flat"
        part = [samples[i] for i in rows]
        shares = balanced_split(part, self.world, tree=tree)
        slots = max(len(micro_batches([part[i] for i in share], self.cfg.micro_batch_tokens, tree=tree))
                    for share in shares)
        mine = [rows[i] for i in shares[self.rank]]
        return StepPlan(self._packed(samples, mine) if mine else [], slots)

    def _idle(self, *, backward: bool) -> None:
        """A zero-weighted micro-batch: joins the collectives of a step whose share ran out."""
        out = self._forward(pack([[0, 0]], mode="flat"))
        if backward:
            (out[0].sum() * 0.0).backward()

    def _sync(self, last: bool):
        if self.par.strategy == "ddp" and not last:
            return self.root.no_sync()  # accumulate locally, all-reduce with the last micro-batch
        return contextlib.nullcontext()

    def _optimiser_step(
        self, samples: list[Sample], part: list[int], plan: StepPlan, proximal: dict[int, torch.Tensor] | None
    ) -> tuple[dict[str, float], int, int]:
        chosen = [samples[i] for i in part]
        num_tokens = sum(sum(s.loss_mask[1:]) for s in chosen)  # the whole part's, over every rank
        num_samples = sum(1 for s in chosen if any(s.loss_mask[1:]))
        mine, steps = plan.micro, plan.slots
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, list[tuple[float, float]]] = defaultdict(list)
        tokens = torch.zeros(2, dtype=torch.long)
        for k in range(steps):
            with self._sync(last=k == steps - 1):
                if k < len(mine):
                    rows, batch = mine[k]
                    packed, flat = self._micro_step(samples, rows, batch, proximal, num_tokens, num_samples, acc)
                    tokens += torch.tensor([packed, flat])
                else:
                    self._idle(backward=True)
        grad_norm = self._clip_and_step()
        gathered: list[dict | None] = [None] * self.world
        dist.all_gather_object(gathered, dict(acc))
        merged: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for part_acc in gathered:
            for key, vals in part_acc.items():
                merged[key].extend(vals)
        dist.all_reduce(tokens)
        return {**_merge_metrics(merged), "train/grad_norm": grad_norm}, int(tokens[0]), int(tokens[1])

    def _global_grad_norm(self) -> float:
        """float64 over every rank's shard under fsdp2 (DDP's gradients are whole on each rank)."""
        sq = self._grad_sq_sum()
        if self.par.strategy == "fsdp2":
            dist.all_reduce(sq)
        return float(sq.sqrt())

    @torch.no_grad()
    def _logprobs(self, plans: list[StepPlan]) -> dict[int, torch.Tensor]:
        """The proximal log-probs of the samples this rank trains in any part of the step (its packed
        micro-batches; idle forwards where another rank has more, so fsdp2's gathers pair up)."""
        out: dict[int, torch.Tensor] = {}
        for plan in plans:
            for k in range(plan.slots):
                if k < len(plan.micro):
                    rows, batch = plan.micro[k]
                    for i, lp in zip(rows, self._forward(batch)):
                        out[i] = lp.detach()
                elif self.par.strategy == "fsdp2":
                    self._idle(backward=False)
        return out

    # -- weights out of the shards ----------------------------------------------------------------
    @torch.no_grad()
    def engine_state(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole (on every rank: all-gathers); rank 0 publishes it."""
        return {k: _full(v).detach().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def stream_state(self) -> Iterator[dict[str, torch.Tensor]]:
        """The weights one layer at a time: each chunk (a decoder layer's parameters, or one other
        tensor) is gathered, yielded, and dropped before the next, so a rank holds about one layer."""
        state = self.model.state_dict()
        chunks: dict[str, list[str]] = {}
        for name in state:
            m = re.match(r"(.*\.layers\.\d+)\.", name)
            chunks.setdefault(m.group(1) if m else name, []).append(name)
        for names in chunks.values():
            yield {k: _full(state[k]).detach().clone() for k in names}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimiser state (local shards)."""
        def nbytes(t: torch.Tensor | None) -> int:
            if t is None or not isinstance(t, torch.Tensor):
                return 0
            loc = _local(t)
            return loc.numel() * loc.element_size()

        params = sum(nbytes(p) for p in self.model.parameters())
        grads = sum(nbytes(p.grad) for p in self.model.parameters())
        optim = sum(nbytes(v) for st in self.optimizer.state.values() for v in st.values())
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def single_state_bytes(trainer: Trainer) -> dict[str, int]:
    """The same accounting for a one-process trainer."""
    return ShardedTrainer.state_bytes(trainer)  # type: ignore[arg-type]


def full_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered whole (for ``RankGroup.run``: comparisons, the bench)."""
    return {n: _full(p.grad).detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter, gathered whole."""
    return {n: _full(p).detach().clone() for n, p in trainer.model.named_parameters()}
