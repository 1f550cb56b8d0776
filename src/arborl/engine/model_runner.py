"""Prefill and decode forwards over the KV slots, through the shared decoder forward
(``arborl.models.forward``): the weights the trainer updates are the weights we serve, and the
numbers match a plain ``model(input_ids)`` forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arborl.engine.kv_cache import SlotKVCache
from arborl.engine.packed import PackedLinears, packing_available
from arborl.engine.packed_forward import PackedForward
from arborl.engine import tree_attention as tree_kernel
from arborl.models.forward import DecoderShape, decoder_hidden, lm_logits
from arborl.models.lora import Adapter, split_adapters
from arborl.models.quantize import has_bf16_linears, is_low_precision, load_serving_weights
from arborl.types import ArborlError


class ModelRunner:
    def __init__(
        self, model: nn.Module, *, slots: int, max_len: int, packed: bool = False, attention: str = "auto",
        row_kernel_max_rows: int = 0,
    ) -> None:
        shape = DecoderShape.of(model, max_len)
        self.model = model
        self.scaling = shape.scaling
        self.gqa = shape.gqa
        self.vocab_size = shape.vocab_size
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        # decode and verify attention: our batch-invariant kernel, or SDPA (engine.attention)
        self.tree_kernel = self._tree_kernel_wanted(attention)
        self.kv = SlotKVCache(
            layers=shape.layers,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            slots=slots,
            max_len=max_len,
            # the CPU bf16 rollout keeps its KV in bf16 where the kernel reads it: half the bytes per step
            dtype=torch.bfloat16 if self.tree_kernel and has_bf16_linears(model) else self.dtype,
            device=self.device,
        )
        self.last_hidden: torch.Tensor | None = None  # hidden states (before the final norm) of the last forward
        # prepacked CPU weights (engine.cpu_packed_weights); None: the model's own Linear modules
        self.linear = PackedLinears(model, row_kernel_max_rows) if packed and packing_available(model) else None
        self.weights_released = False  # release_weights() until the next load_weights
        # the lean forward over those packed weights where the model is a plain Llama-layout decoder
        self.packed_forward = (PackedForward(model, self.linear)
                               if self.linear is not None and PackedForward.supports(model, self.linear) else None)
        self._adapter_hooks: list = []  # forward hooks serving adapters on modules without a pack

    def _tree_kernel_wanted(self, attention: str) -> bool:
        if attention == "sdpa":
            return False
        fits = self.dtype == torch.float32 and self.device.type == "cpu"
        if attention == "kernel":
            if not fits:
                raise ArborlError(f"engine.attention=kernel runs float32 on the CPU, not {self.dtype} on {self.device}")
            if not tree_kernel.available():
                raise ArborlError(f"engine.attention=kernel: the kernel did not build ({tree_kernel.build_error()}); "
                                  "install a C++ compiler and ninja, or set engine.attention=sdpa")
            return True
        if attention != "auto":
            raise ArborlError(f"engine.attention must be auto, kernel or sdpa, not {attention!r}")
        return fits and tree_kernel.available()

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, make_attend) -> torch.Tensor:
        if self.packed_forward is not None:
            return self.packed_forward.hidden(input_ids, position_ids, make_attend)
        return decoder_hidden(self.model, input_ids, position_ids, make_attend, self.linear)

    @torch.inference_mode()
    def prefill(self, items: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Prefill several sequences in one forward. Each item is (slot, token_ids, start): the tokens
        go to positions [start, start+len) of the slot, whose KV for [0, start) is already there.
        The projections and MLPs run on all tokens at once; attention runs per sequence (the kernel:
        per token, as decode does, so a prompt's KV and logits do not depend on how it was chunked).
        Returns the logits after each item's last token, [len(items), vocab]."""
        ids, positions, spans, masks = [], [], [], []
        offset = 0
        for slot, token_ids, start in items:
            n = len(token_ids)
            end = start + n
            ids += token_ids
            pos = torch.arange(start, end, device=self.device)
            positions.append(pos)
            spans.append((slot, start, end, offset))
            # query at absolute position p sees keys 0..p (None: plain causal, faster kernel)
            if not self.tree_kernel:  # SDPA's mask; the kernel takes each row's key count instead
                masks.append(None if start == 0 else (torch.arange(end, device=self.device)[None, :] <= pos[:, None]))
            offset += n
        input_ids = torch.tensor([ids], device=self.device)
        position_ids = torch.cat(positions).unsqueeze(0)
        self.kv.ensure(max(end for _, _, end, _ in spans), max(slot for slot, *_ in spans) + 1)

        if self.tree_kernel:  # the token at position p attends to keys [0, p] of its slot
            row_slot = torch.tensor([slot for slot, start, end, _ in spans for _ in range(end - start)], device=self.device)
            row_keys = position_ids[0] + 1
            no_extra = torch.empty(len(ids), 0, dtype=torch.long, device=self.device)

        def make_attend(layer_idx: int):
            kc, vc = self.kv.layer(layer_idx)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                if self.tree_kernel:  # it writes each token's K/V at its position, then attends
                    new_kv = (k[0].transpose(0, 1), v[0].transpose(0, 1), position_ids[0])
                    out = tree_kernel.tree_attention(q[0].transpose(0, 1), kc, vc, row_slot, row_keys, no_extra,
                                                     self.scaling, new_kv)
                    return out.transpose(0, 1).unsqueeze(0)
                for slot, start, end, off in spans:
                    kc[slot, :, start:end] = k[0, :, off : off + end - start]
                    vc[slot, :, start:end] = v[0, :, off : off + end - start]
                return torch.cat([
                    F.scaled_dot_product_attention(
                        q[:, :, off : off + end - start],
                        kc[slot : slot + 1, :, :end],
                        vc[slot : slot + 1, :, :end],
                        attn_mask=mask,
                        is_causal=mask is None,
                        scale=self.scaling,
                        enable_gqa=self.gqa,
                    )
                    for (slot, start, end, off), mask in zip(spans, masks)
                ], dim=2)

            return attend

        last = torch.tensor([off + (end - start) - 1 for _, start, end, off in spans], device=self.device)
        h = self._hidden(input_ids, position_ids, make_attend)
        self.last_hidden = h[0, last]  # the rows behind the logits returned (the mtp drafter reads them)
        return lm_logits(self.model, self.last_hidden, self.linear)

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of the sequences in slots 0..n-1, at the given positions. Returns [n, vocab]."""
        n = len(token_ids)
        ids = torch.tensor(token_ids, device=self.device).unsqueeze(1)
        pos = torch.tensor(positions, device=self.device)
        length = int(max(positions)) + 1
        self.kv.ensure(length, n)
        rows = torch.arange(n, device=self.device)
        if self.tree_kernel:
            own = pos.unsqueeze(1)  # each row's keys: [0, pos) then pos itself
        else:
            mask = (torch.arange(length, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]

        def make_attend(layer_idx: int):
            kc, vc = self.kv.layer(layer_idx)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                if self.tree_kernel:  # writes the token's K/V at pos, attends to keys [0, pos) then pos itself
                    new_kv = (k[:, :, 0], v[:, :, 0], pos)
                    return tree_kernel.tree_attention(q[:, :, 0], kc, vc, rows, pos, own, self.scaling, new_kv).unsqueeze(2)
                kc[rows, :, pos] = k[:, :, 0]
                vc[rows, :, pos] = v[:, :, 0]
                return F.scaled_dot_product_attention(
                    q, kc[:n, :, :length], vc[:n, :, :length], attn_mask=mask, scale=self.scaling, enable_gqa=self.gqa
                )

            return attend

        h = self._hidden(ids, pos.unsqueeze(1), make_attend)
        self.last_hidden = h[:, -1]
        return lm_logits(self.model, self.last_hidden, self.linear)

    @torch.inference_mode()
    def verify(self, items: list[tuple[int, int, list[int], list[int]]]) -> torch.Tensor:
        """One forward over draft trees, one per sequence. Each item is (slot, start, token_ids,
        parents): node 0 is the sequence's last token at position ``start`` (the slot holds KV for
        [0, start)), node i > 0 hangs under ``parents[i]`` and sits at position start + its depth; its
        KV goes to slot position start + i. A node attends to the slot's [0, start) and to its own
        ancestors. Returns logits [len(items), max nodes, vocab] (padding rows are garbage)."""
        if self.tree_kernel:
            return self._verify_ragged(items)
        return self._verify_padded(items)

    def _verify_ragged(self, items: list[tuple[int, int, list[int], list[int]]]) -> torch.Tensor:
        """The kernel's verify: every sequence's nodes side by side in one row of tokens (no padding to
        the widest tree, so a sequence without a draft costs one row), each node attending to [0, start)
        then its chain of ancestors' slot positions."""
        dev = self.device
        ids, pos, slots, prefix, chains, rows, cols = [], [], [], [], [], [], []
        for r, (slot, start, toks, parents) in enumerate(items):
            chain: list[list[int]] = []
            for i, p in enumerate(parents):
                chain.append((chain[p] if p >= 0 else []) + [start + i])
            chains += chain
            ids += toks
            pos += [start + len(c) - 1 for c in chain]
            slots += [slot] * len(toks)
            prefix += [start] * len(toks)
            rows += [r] * len(toks)
            cols += range(len(toks))
        self.kv.ensure(max(start + len(t) for _, start, t, _ in items), max(slot for slot, *_ in items) + 1)
        deepest = max(len(c) for c in chains)
        extra = torch.tensor([c + [-1] * (deepest - len(c)) for c in chains], device=dev)
        slots_t, prefix_t = torch.tensor(slots, device=dev), torch.tensor(prefix, device=dev)
        kv_pos = torch.tensor([c[-1] for c in chains], device=dev)  # node i of a tree: slot position start + i

        def make_attend(layer_idx: int):
            kc, vc = self.kv.layer(layer_idx)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                new_kv = (k[0].transpose(0, 1), v[0].transpose(0, 1), kv_pos)
                out = tree_kernel.tree_attention(q[0].transpose(0, 1), kc, vc, slots_t, prefix_t, extra, self.scaling, new_kv)
                return out.transpose(0, 1).unsqueeze(0)

            return attend

        h = self._hidden(torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), make_attend)[0]
        logits = lm_logits(self.model, h, self.linear)
        # the padded layout callers index: [sequence, node]
        width = max(len(t) for _, _, t, _ in items)
        at = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        self.last_hidden = h.new_empty(len(items), width, h.shape[-1]).index_put_(at, h)
        return logits.new_empty(len(items), width, logits.shape[-1]).index_put_(at, logits)

    def _verify_padded(self, items: list[tuple[int, int, list[int], list[int]]]) -> torch.Tensor:
        """SDPA's verify: the trees padded to the widest, one boolean mask for the ancestors."""
        b = len(items)
        width = max(len(t) for _, _, t, _ in items)
        length = max(start + len(t) for _, start, t, _ in items)
        self.kv.ensure(length, max(slot for slot, *_ in items) + 1)
        ids = torch.zeros(b, width, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, 1, width, length, dtype=torch.bool)
        w_rows, w_cols, w_slots, w_pos = [], [], [], []
        for r, (slot, start, toks, parents) in enumerate(items):
            n = len(toks)
            ids[r, :n] = torch.tensor(toks)
            depth = [0] * n
            anc = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                p = parents[i]
                if p >= 0:
                    depth[i] = depth[p] + 1
                    anc[i] = anc[p]
                anc[i, i] = True
            pos[r, :n] = start + torch.tensor(depth)
            mask[r, 0, :, :start] = True  # padding rows see the prefix too (no all-masked row: NaN)
            mask[r, 0, :n, start : start + n] = anc
            if start == 0:
                mask[r, 0, n:, 0] = True
            w_rows += [r] * n
            w_cols += range(n)
            w_slots += [slot] * n
            w_pos += range(start, start + n)
        dev = self.device
        ids, pos, mask = ids.to(dev), pos.to(dev), mask.to(dev)
        w_rows_t, w_cols_t = torch.tensor(w_rows, device=dev), torch.tensor(w_cols, device=dev)
        w_slots_t, w_pos_t = torch.tensor(w_slots, device=dev), torch.tensor(w_pos, device=dev)
        slot_ids = [slot for slot, _, _, _ in items]
        # running sequences fill slots 0..n-1 in order: a view then, not a gather
        slots = slice(0, b) if slot_ids == list(range(b)) else torch.tensor(slot_ids, device=dev)

        def make_attend(layer_idx: int):
            kc, vc = self.kv.layer(layer_idx)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                kc[w_slots_t, :, w_pos_t] = k[w_rows_t, :, w_cols_t]
                vc[w_slots_t, :, w_pos_t] = v[w_rows_t, :, w_cols_t]
                return F.scaled_dot_product_attention(
                    q, kc[slots, :, :length], vc[slots, :, :length], attn_mask=mask, scale=self.scaling, enable_gqa=self.gqa
                )

            return attend

        h = self._hidden(ids, pos, make_attend)
        self.last_hidden = h
        return lm_logits(self.model, h, self.linear)

    def release_weights(self) -> int:
        """Free the packed weights (with ``release_module_weights``, the runner's only copy of them) until the
        next ``load_weights``, which must carry every one of them; nothing may run meanwhile. Returns the bytes
        freed."""
        if self.linear is None:
            return 0
        self.weights_released = True
        return self.linear.drop()

    def release_module_weights(self) -> int:
        """Free the Linear weights the packed copies replace (the model must be this runner's alone);
        returns the bytes freed (0 without packed weights)."""
        return self.linear.release_module_weights() if self.linear is not None else 0

    def _held_weights(self, state: dict[str, torch.Tensor]) -> dict[nn.Module, torch.Tensor]:
        """Take out of ``state`` the new weights (and biases, set in place) of modules whose weight lives only
        in the packs; the new weights by module (a module not in ``state`` keeps its pack)."""
        held = self.linear.held() if self.linear is not None else {}
        if not held:
            return {}
        new: dict[nn.Module, torch.Tensor] = {}
        for name, module in self.model.named_modules():
            if module not in held:
                continue
            w = state.pop(f"{name}.weight", None)
            b = state.pop(f"{name}.bias", None)
            if w is None:
                if b is not None:
                    raise ArborlError(f"update_weights: {name}.bias without its weight; this engine keeps its Linear "
                                      "weights only in its packed copies, which are rebuilt from the weight")
                continue
            if tuple(w.shape) != tuple(held[module]):
                raise ArborlError(f"update_weights: {name}.weight has shape {tuple(w.shape)}, "
                                  f"expected {tuple(held[module])}")
            new[module] = w
            if b is not None and module.bias is not None:
                module.bias.copy_(b)
        return new

    def _changed_modules(self, state: dict[str, torch.Tensor]) -> set[nn.Module]:
        """The modules some of whose own parameters ``state`` sets."""
        owners = {key.rpartition(".")[0] for key in state}
        return {m for name, m in self.model.named_modules() if name in owners}

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``state`` (any subset of the model's weights: the packs of modules it does not touch stay) and
        serve the LoRA adapters it carries (``models.lora``'s entries) on top; a state without adapter entries
        leaves none."""
        state, adapters = split_adapters(state)
        self._check_adapters(adapters)
        changed = self._changed_modules(state)
        new = self._held_weights(state)
        if is_low_precision(self.model):  # int8 / FP8 / bf16 serving copy: re-quantise what arrives (I5)
            load_serving_weights(self.model, state)
        else:
            params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights under both names
            params.update(dict(self.model.named_buffers(remove_duplicate=False)))
            unknown = sorted(set(state) - set(params))
            if unknown:
                raise ArborlError(f"update_weights: {len(unknown)} unknown parameter name(s), e.g. {unknown[0]!r}")
            for name, tensor in state.items():
                if params[name].shape != tensor.shape:
                    raise ArborlError(
                        f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                    )
            for name, tensor in state.items():
                params[name].copy_(tensor)
        if self.linear is not None and (changed or self.weights_released):
            self.linear.refresh(new, changed)
        self.weights_released = False
        self._serve_adapters(adapters)

    def _check_adapters(self, adapters: dict[str, Adapter]) -> None:
        modules = dict(self.model.named_modules())
        for name, ad in adapters.items():
            m = modules.get(name)
            if m is None or not hasattr(m, "in_features"):
                raise ArborlError(f"update_weights: an adapter for {name!r}, which is not a Linear module of the model")
            if tuple(ad.a.shape[1:]) != (m.in_features,) or ad.b.shape[0] != m.out_features:
                raise ArborlError(f"update_weights: the adapter of {name} maps {ad.a.shape[1]} -> {ad.b.shape[0]}, "
                                  f"the module {m.in_features} -> {m.out_features}")

    def _serve_adapters(self, adapters: dict[str, Adapter]) -> None:
        """Adapters on packed modules ride in their packs; the others (modules the engine runs as they are)
        add their term through a forward hook."""
        for handle in self._adapter_hooks:
            handle.remove()
        self._adapter_hooks = []
        by_module = {m: adapters[name] for name, m in self.model.named_modules() if name in adapters}
        loose = self.linear.set_adapters(by_module) if self.linear is not None else set(by_module)
        for m in loose:
            ad = by_module[m]
            ad = Adapter(ad.a.to(self.device), ad.b.to(self.device), ad.scale)

            def hook(module: nn.Module, args: tuple, out: torch.Tensor, ad: Adapter = ad) -> torch.Tensor:
                return out + ad.apply(args[0].to(ad.a.dtype)).to(out.dtype)

            self._adapter_hooks.append(m.register_forward_hook(hook))
