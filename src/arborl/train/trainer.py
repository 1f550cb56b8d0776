"""The policy trainer: one batch of samples -> ppo_epochs x minibatches optimiser steps (default 1 x 1).

    parts = train.minibatches pieces of the batch (groups kept adjacent)
    plan  = each part cut into micro-batches (<= micro_batch_tokens) and packed (flat or prefix tree),
            once per step: every pass and the proximal forward reuse them
    prox  = the policy's log-probs before any update of this step        # an extra forward when it takes
                                                                         # several optimiser steps
    for each pass (train.ppo_epochs), for each part:
        for each of its packed micro-batches:
            forward  ->  per-sample log-probs logp (+ entropies)
            rollout_logprobs = the samples' (their sample_logprobs when the trainer is tempered)
            w    = rollout_correction(logp, rollout_logprobs)           # S3: TIS / MIS / IcePop weights
            w   *= pi_prox / pi_behav, 0 above the cap                  # train.decoupled (AReaL)
            old_logprobs = prox (train.old_logprobs=trainer) or rollout_logprobs (=rollout)
            loss = policy_loss(cfg.loss, logp, old_logprobs, advantages, w, ...)  # train.loss.kind, KL, entropy
            loss.backward()                                             # normalised by the whole part
        clip gradients; AdamW step
    publish weights to the engines (version + 1; the controller does it)

The ratio pi / pi_old is 1 on the first optimiser step with old_logprobs=trainer, so clipping acts
only from the second step (a second part or pass) or against the behaviour policy (rollout, or
decoupled for stale async data). Per step the metrics hold clip fractions (loss/clip_frac_low,
_high), loss/approx_kl (k3 KL(old || new)), ratio mean/min/max/std and train/optimizer_steps.

Sample fields are per token; the log-prob tensors are per next-token prediction, so the trainer
aligns them by dropping each sample's first token (a prompt token never carries loss).

After a step, ``step_logprobs`` holds each sample's log-probs as the step's first forward of it
scored them (``prox`` above when there is one: the policy before the step's first update), on the
CPU; the controller records them per call in the data pool, for the rollout/trainer mismatch view.
"""

from __future__ import annotations

import copy
import math
import operator
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from arborl.config import TrainConfig
from arborl.models.forward import DecoderShape
from arborl.models.lora import Adapter, adapter_entries, merge
from arborl.prefix import RadixTree
from arborl.train.corrections import decoupled_weights, rollout_correction
from arborl.train.losses import policy_loss, resolve_loss
from arborl.train.memory import StepMemory, activation_bytes_per_token, check_fits, held_bytes, step_memory
from arborl.train.packing import PackedBatch, pack, packed_logprobs
from arborl.types import InvalidRequestError, Sample


def micro_batches(
    samples: list[Sample], token_budget: int, *, tree: bool = False
) -> list[tuple[list[int], RadixTree[None] | None]]:
    """Indices of ``samples`` split into micro-batches of at most ``token_budget`` tokens to compute
    (a longer sample goes alone): flat tokens, or with ``tree`` the tokens of their prefix tree, so
    samples sharing prefixes fill a micro-batch by what the forward really computes. Samples of one
    group stay adjacent, so their shared prompt is packed once. Each micro-batch comes with the prefix
    tree of its samples (None without ``tree``), for ``pack(..., tree=)``: it is not built twice."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].group_id, i))
    batches: list[tuple[list[int], RadixTree[None] | None]] = []
    current: list[int] = []
    prefixes: RadixTree[None] = RadixTree()
    used = 0
    for i in order:
        tokens = samples[i].token_ids
        added = len(tokens) - (prefixes.match_prefix(tokens).length if tree else 0)  # what it adds to compute
        if current and used + added > token_budget:
            batches.append((current, prefixes if tree else None))
            current, prefixes, used, added = [], RadixTree(), 0, len(tokens)
        if tree:
            prefixes.insert(tokens)
        current.append(i)
        used += added
    if current:
        batches.append((current, prefixes if tree else None))
    return batches


@dataclass(eq=False)
class StepPlan:
    """One optimiser step's micro-batches that this process runs, packed once per step (every pass and
    the proximal forward reuse them): ``micro`` = (indices into the step's samples, their PackedBatch);
    ``slots`` = micro-batches every process of the step runs (under train.parallel a rank with fewer
    runs idle ones; one process: len(micro))."""

    micro: list[tuple[list[int], PackedBatch]]
    slots: int


def _per_token(samples: list[Sample], field: str | Callable[[Sample], list], dtype: torch.dtype, device) -> torch.Tensor:
    """[B, T-1] padded tensor of a per-token Sample field (a name, or a function of the sample),
    aligned with next-token predictions."""
    get = field if callable(field) else operator.attrgetter(field)
    rows = [torch.tensor(get(s)[1:], dtype=dtype) for s in samples]
    return pad_sequence(rows, batch_first=True).to(device)


SUMMED = ("loss/total", "loss/pg")  # already normalised by the whole (mini)batch: micro-batch parts add up


def _plain_name(key: str) -> str:
    """A peft-wrapped module's parameter name as the plain model names it."""
    return key.replace(".base_layer.", ".")


def _merge_metrics(acc: dict[str, list[tuple[float, float]]], summed: tuple[str, ...] = SUMMED) -> dict[str, float]:
    """Merge (value, weight) lists: ``*max`` / ``*min`` by max / min, ``summed`` keys and ``*tokens`` counts by
    sum, ``*_std`` pooled with its ``*_mean`` sibling, everything else by the weighted mean."""
    out = {}
    for key, vals in acc.items():
        xs = [v for v, _ in vals]
        total = sum(w for _, w in vals)
        if key.endswith("max"):
            out[key] = max(xs)
        elif key.endswith("min"):
            out[key] = min(xs)
        elif key in summed or key.endswith("tokens"):
            out[key] = sum(xs)
        elif key.endswith("_std") and key[:-4] + "_mean" in acc and total:
            means = [v for v, _ in acc[key[:-4] + "_mean"]]
            mean = sum(mu * w for mu, (_, w) in zip(means, vals)) / total
            second = sum((sd * sd + mu * mu) * w for sd, mu, (_, w) in zip(xs, means, vals)) / total
            out[key] = math.sqrt(max(second - mean * mean, 0.0))
        else:
            out[key] = sum(v * w for v, w in vals) / total if total else 0.0
    return out


def minibatch_split(samples: list[Sample], parts: int) -> list[list[int]]:
    """Indices of ``samples`` sorted by group (a group stays adjacent) and cut into ``parts`` contiguous,
    equally sized pieces (at most one per sample): the optimiser steps of one pass."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].group_id, i))
    n = max(1, min(parts, len(order)))
    return [order[k * len(order) // n : (k + 1) * len(order) // n] for k in range(n)]


class Trainer:
    def __init__(self, model: nn.Module, cfg: TrainConfig, *, temperature: float = 1.0) -> None:
        """``temperature``: the sampling temperature of the rollouts; the trainer optimises
        softmax(logits / temperature), the policy the samples came from (their rollout log-probs
        must be under that distribution too)."""
        if temperature <= 0:
            raise InvalidRequestError("the trainer's temperature must be > 0 (greedy rollouts cannot be trained on)")
        resolve_loss(cfg.loss)  # train.loss.kind and its settings: a ConfigError naming the key, before any work
        self.cfg = cfg
        self.temperature = temperature
        self.model = self._with_lora(model) if cfg.lora_rank > 0 else model
        # the HF model whose modules we run (under LoRA: the base model with adapters injected)
        self.policy = self.model.get_base_model() if cfg.lora_rank > 0 else self.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise InvalidRequestError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
        )
        # KL needs a frozen reference: the base model under LoRA, else a copy of the start weights
        self.ref_model = self._make_ref(model) if cfg.loss.kl_coef > 0 and cfg.lora_rank == 0 else None
        self.step = 0
        self.device = next(self.model.parameters()).device
        self.step_logprobs: dict[int, torch.Tensor] = {}  # sample index -> [len - 1], of the last step
        self._activation_per_token: float | None = None  # bytes, measured at the first memory check

    def _make_ref(self, model: nn.Module) -> nn.Module:
        """The frozen KL reference: a copy of the start weights."""
        return copy.deepcopy(model).eval().requires_grad_(False)

    def _with_lora(self, model: nn.Module) -> nn.Module:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as e:  # pragma: no cover - depends on the install
            raise InvalidRequestError("train.lora_rank > 0 needs peft: pip install peft") from e
        lcfg = LoraConfig(
            r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha, target_modules=list(self.cfg.lora_targets),
            lora_dropout=0.0, bias="none",
        )
        return get_peft_model(model, lcfg)

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One batch: ``ppo_epochs`` passes of ``minibatches`` optimiser steps each (see the module
        docstring); returns the step's metrics (losses and ratio statistics averaged over the
        optimiser steps, weighted by their loss tokens; ``*_max`` / ``*_min`` over all of them;
        train/grad_norm their mean, _max their max; train/packed_tokens and _flat_tokens what the
        step's training forwards computed, all optimiser steps together)."""
        for s in samples:
            s.validate()
        t0 = time.perf_counter()
        self.step_logprobs = {}
        num_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
        if num_tokens == 0:
            return {"train/skipped": 1.0, "train/step": float(self.step)}
        cfg = self.cfg
        self.model.train()
        parts = minibatch_split(samples, cfg.minibatches)
        plans = [self._plan(samples, part) for part in parts]  # sized and packed once per step
        self.check_memory(max((b.tokens_packed for p in plans for _, b in p.micro), default=0))
        several = cfg.ppo_epochs * len(parts) > 1
        # pi_old / pi_prox must be the policy before the FIRST update of the step: with several
        # optimiser steps it takes its own forward now; with one, the step's forward gives it
        proximal = self._logprobs(plans) if several and cfg.old_logprobs == "trainer" else None
        if proximal is not None:
            self.step_logprobs = {i: lp.float().cpu() for i, lp in proximal.items()}
        steps: dict[str, list[tuple[float, float]]] = defaultdict(list)
        norms: list[float] = []
        packed_tokens = flat_tokens = 0
        for _ in range(cfg.ppo_epochs):
            for part, plan in zip(parts, plans):
                part_tokens = sum(sum(samples[i].loss_mask[1:]) for i in part)
                if part_tokens == 0:
                    continue
                metrics, packed, flat = self._optimiser_step(samples, part, plan, proximal)
                packed_tokens += packed
                flat_tokens += flat
                norms.append(metrics.pop("train/grad_norm"))
                for k, v in metrics.items():
                    steps[k].append((v, float(part_tokens)))
        self.step += 1
        out = _merge_metrics(steps, summed=())
        for k in [k for k in out if k.endswith("tokens")]:  # each pass sees every token once
            out[k] /= cfg.ppo_epochs
        out.update({
            "train/step": float(self.step),
            "train/grad_norm": sum(norms) / len(norms),
            "train/grad_norm_max": max(norms),
            "train/optimizer_steps": float(len(norms)),
            "train/samples": float(len(samples)),
            "train/loss_tokens": float(num_tokens),
            "train/packed_tokens": float(packed_tokens),
            "train/flat_tokens": float(flat_tokens),
            "train/step_s": time.perf_counter() - t0,
        })
        return out

    def check_memory(self, tokens: int) -> StepMemory | None:
        """The estimated memory of a step whose largest micro-batch packs ``tokens`` tokens (train/memory.py);
        raises TrainMemoryError, naming the knob to lower, when it exceeds train.memory_limit_gb (or the
        device's memory). None when the check is off (memory_limit_gb = 0) or there is nothing to run."""
        if self.cfg.memory_limit_gb == 0 or tokens <= 0:
            return None
        if self._activation_per_token is None:
            self._activation_per_token = activation_bytes_per_token(
                self._probe_forward, self.policy, DecoderShape.of(self.policy).layers)
        need = step_memory(self, tokens, self._activation_per_token)
        check_fits(need, self.cfg.memory_limit_gb, self.device, held=held_bytes(self),
                   checkpointing=self.cfg.checkpoint_layers)
        return need

    def _probe_forward(self, batch):
        """The step's forward on a probe batch, logits one row at a time (their memory is counted apart)."""
        return packed_logprobs(self.policy, batch, with_entropy=self.cfg.loss.entropy_coef > 0,
                               temperature=self.temperature, checkpoint=self.cfg.checkpoint_layers,
                               logits_chunk=1)

    def _plan(self, samples: list[Sample], part: list[int]) -> StepPlan:
        """The samples ``part`` (indices into ``samples``) cut into micro-batches and packed."""
        micro = self._packed(samples, part)
        return StepPlan(micro, len(micro))

    def _packed(self, samples: list[Sample], rows: list[int]) -> list[tuple[list[int], PackedBatch]]:
        """``samples[rows]`` cut into micro-batches, each packed with the prefix tree that sized it."""
        cfg = self.cfg
        chosen = [samples[i] for i in rows]
        out = []
        for idx, prefixes in micro_batches(chosen, cfg.micro_batch_tokens, tree=cfg.packing != "flat"):
            batch = pack([chosen[i].token_ids for i in idx], mode=cfg.packing, token_budget=cfg.micro_batch_tokens,
                         min_saving=cfg.packing_min_saving, tree=prefixes)
            out.append(([rows[i] for i in idx], batch))
        return out

    def _optimiser_step(
        self, samples: list[Sample], part: list[int], plan: StepPlan, proximal: dict[int, torch.Tensor] | None
    ) -> tuple[dict[str, float], int, int]:
        """Gradients of the samples ``part`` (its packed micro-batches ``plan``), clipped, one AdamW step; its
        metrics."""
        chosen = [samples[i] for i in part]
        num_tokens = sum(sum(s.loss_mask[1:]) for s in chosen)
        num_samples = sum(1 for s in chosen if any(s.loss_mask[1:]))
        self.optimizer.zero_grad(set_to_none=True)
        acc: dict[str, list[tuple[float, float]]] = defaultdict(list)
        packed_tokens = flat_tokens = 0
        for rows, batch in plan.micro:
            packed, flat = self._micro_step(samples, rows, batch, proximal, num_tokens, num_samples, acc)
            packed_tokens += packed
            flat_tokens += flat
        grad_norm = self._clip_and_step()
        return {**_merge_metrics(acc), "train/grad_norm": grad_norm}, packed_tokens, flat_tokens

    def _micro_step(
        self, samples: list[Sample], rows: list[int], batch: PackedBatch, proximal: dict[int, torch.Tensor] | None,
        num_tokens: int, num_samples: int, acc: dict[str, list[tuple[float, float]]],
    ) -> tuple[int, int]:
        """Forward and backward of the micro-batch ``samples[rows]`` (packed: ``batch``), its loss normalised by
        the optimiser step's ``num_tokens`` / ``num_samples``; appends its metrics to ``acc``; returns (packed,
        flat) tokens."""
        cfg = self.cfg
        tempered = self.temperature != 1.0  # the trainer scores softmax(logits / T): compare with the same distribution
        mb = [samples[i] for i in rows]
        want_entropy = cfg.loss.entropy_coef > 0
        out = self._forward(batch, with_entropy=want_entropy)
        lps, ents = out if want_entropy else (out, None)
        for i, lp in zip(rows, lps):  # the step's first score of each sample (see the module docstring)
            if i not in self.step_logprobs:
                self.step_logprobs[i] = lp.detach().float().cpu()
        logp = pad_sequence(lps, batch_first=True)
        entropy = pad_sequence(ents, batch_first=True) if ents is not None else None
        dtype = logp.dtype
        mask = _per_token(mb, "loss_mask", dtype, self.device)
        rollout_logprobs = _per_token(mb, lambda s: s.behaviour_logprobs(tempered), dtype, self.device)
        adv = _per_token(mb, "advantages", dtype, self.device)
        chunks = _per_token(mb, "chunk_ids", torch.long, self.device)
        if proximal is None:
            prox = logp.detach()
        else:
            prox = pad_sequence([proximal[i] for i in rows], batch_first=True).to(self.device, dtype)
        weights, corr = rollout_correction(
            logp.detach(), rollout_logprobs, mask, chunk_ids=chunks, **cfg.correction.model_dump()
        )
        if cfg.decoupled:
            w_dec, dec = decoupled_weights(prox, rollout_logprobs, mask, cap=cfg.decoupled_weight_cap)
            weights, corr = weights * w_dec, {**corr, **dec}
        old_logprobs = prox if cfg.old_logprobs == "trainer" else rollout_logprobs
        ref = self._ref_logprobs(batch) if cfg.loss.kl_coef > 0 else None
        loss, metrics = policy_loss(
            cfg.loss, logp, old_logprobs, adv, mask, weights=weights, ref_logprobs=ref, entropy=entropy,
            chunk_ids=chunks, rollout_logprobs=rollout_logprobs, num_tokens=num_tokens, num_samples=num_samples,
        )
        loss.backward()
        w = float(mask.sum())
        for k, v in {**metrics, **corr}.items():
            acc[k].append((float(v), w))
        return batch.tokens_packed, batch.tokens_flat

    def _forward(self, batch, *, with_entropy: bool = False):
        """The policy's per-sample log-probs (and entropies) of a packed batch."""
        return packed_logprobs(self.policy, batch, with_entropy=with_entropy, temperature=self.temperature,
                               checkpoint=self.cfg.checkpoint_layers, logits_chunk=self.cfg.logits_chunk_tokens,
                               trim_heap=self.cfg.release_heap_per_layer and self.device.type == "cpu")

    def _grad_sq_sum(self) -> torch.Tensor:
        """Sum of the squared gradients this process holds, accumulated in float64."""
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.params if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
        for g in grads:  # on the gradients' device: no host sync per tensor
            total += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
        return total

    def _global_grad_norm(self) -> float:
        """The gradients' global L2 norm, accumulated in float64: torch's float32 norm of SmolLM2-135M's
        gradients was 3.3e-5 off the float64 one, and clipping scales every gradient by that error."""
        return float(self._grad_sq_sum().sqrt())

    def _clip_and_step(self) -> float:
        """Clip the gradients' global norm (torch's rule: x max_norm / (norm + 1e-6) when above it), take
        the AdamW step; the norm before clipping."""
        grad_norm = self._global_grad_norm()
        if self.cfg.grad_clip > 0 and math.isfinite(grad_norm):
            coef = min(self.cfg.grad_clip / (grad_norm + 1e-6), 1.0)
            if coef < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        return grad_norm

    @torch.no_grad()
    def _logprobs(self, plans: list[StepPlan]) -> dict[int, torch.Tensor]:
        """The current policy's next-token log-probs of every sample the step's packed micro-batches hold
        (index -> [len - 1]), no gradient."""
        out: dict[int, torch.Tensor] = {}
        for plan in plans:
            for rows, batch in plan.micro:
                for i, lp in zip(rows, self._forward(batch)):
                    out[i] = lp.detach()
        return out

    @torch.no_grad()
    def _ref_logprobs(self, batch) -> torch.Tensor:
        if self.ref_model is not None:
            lps = packed_logprobs(self.ref_model, batch, temperature=self.temperature,
                                  logits_chunk=self.cfg.logits_chunk_tokens)
        else:  # LoRA: the base model is the model with its adapters off
            with self.model.disable_adapter():
                lps = packed_logprobs(self.policy, batch, temperature=self.temperature,
                                      logits_chunk=self.cfg.logits_chunk_tokens)
        return pad_sequence(lps, batch_first=True)

    # -- weights for the engines ------------------------------------------------------------------
    @torch.no_grad()
    def engine_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the plain model's parameter names (LoRA merged in), which the engines
        may load while training goes on: what training changes is copied (a tied weight once), a frozen
        tensor (LoRA's base) is handed over as it is, never written (no second full copy of the base)."""
        frozen = {(p.data_ptr(), p.shape) for p in self.model.parameters() if not p.requires_grad}
        copies: dict[tuple, torch.Tensor] = {}

        def snapshot(v: torch.Tensor) -> torch.Tensor:
            key = (v.data_ptr(), v.shape)
            if key in frozen:
                return v.detach()
            if key not in copies:
                copies[key] = v.detach().clone()
            return copies[key]

        if self.cfg.lora_rank == 0:
            return {k: snapshot(v) for k, v in self.model.state_dict().items()}
        state = {k: snapshot(v) for k, v in self.policy.state_dict().items() if "lora_" not in k}
        for name, adapter in self._adapters()[0].items():
            key = f"{name}.base_layer.weight"
            state[key] = merge(state[key], adapter)  # a new tensor: the base stays
        return {_plain_name(k): v for k, v in state.items()}

    def _adapters(self) -> tuple[dict[str, Adapter], bool]:
        """The LoRA adapters by their module's name in ``policy`` (views of the live parameters), oriented as the
        module's weight (``merge`` adds ``scale * b @ a`` to it), and whether every adapted module is a plain
        Linear (a fan-in-fan-out Conv1D stores its weight transposed: merged, never served as an adapter)."""
        from peft.tuners.lora import LoraLayer

        out: dict[str, Adapter] = {}
        plain = True
        for name, module in self.policy.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
                if getattr(module, "fan_in_fan_out", False):  # delta = (B @ A).T = A.T @ B.T
                    a, b, plain = b.T, a.T, False
                out[name] = Adapter(a, b, float(module.scaling["default"]))
        return out, plain

    @torch.no_grad()
    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """Under LoRA: copies of the adapters only (``models.lora``'s published form, plain module names),
        which an engine that serves adapters applies on the base it holds; None without LoRA, or where an adapted
        module is not a plain Linear (those publish merged weights)."""
        if self.cfg.lora_rank == 0:
            return None
        adapters, plain = self._adapters()
        if not plain:
            return None
        out: dict[str, torch.Tensor] = {}
        for name, ad in adapters.items():
            out.update(adapter_entries(_plain_name(name), Adapter(ad.a.clone(), ad.b.clone(), ad.scale)))
        return out

    # -- checkpoints (the TrainerFace) ------------------------------------------------------------
    def save(self, path: str | Path, extra: dict[str, Any] | None = None, *, tokenizer: Any = None,
             also: Callable[[Path], None] | None = None) -> Path:
        from arborl.train.checkpoint import save_checkpoint

        return save_checkpoint(path, self, extra, tokenizer=tokenizer, also=also)

    def load(self, path: str | Path) -> dict[str, Any]:
        from arborl.train.checkpoint import load_checkpoint

        return load_checkpoint(path, self)

    def close(self) -> None:
        """Nothing to release: the model is the caller's."""

    @torch.no_grad()
    def base_state(self) -> dict[str, torch.Tensor]:
        """Under LoRA: the frozen base weights under plain names, by reference (never written); else the
        whole model's weights, copied as in ``engine_state``."""
        if self.cfg.lora_rank == 0:
            return self.engine_state()
        return {_plain_name(k): v.detach() for k, v in self.policy.state_dict().items() if "lora_" not in k}
