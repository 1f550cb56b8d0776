"""Forward passes over a Hugging Face decoder (Llama / Qwen2 / Qwen3 / Mistral layout) with our KV slots.

The model's own modules (embeddings, norms, projections, MLPs, rotary embedding, LM head) do the
arithmetic; only attention and the KV bookkeeping are ours, so the weights the trainer updates are
the weights we serve and the numbers match a plain ``model(input_ids)`` forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arborl.engine.kv_cache import SlotKVCache
from arborl.types import ArborlError


class UnsupportedModelError(ArborlError):
    """The model's architecture is not one the built-in engine can run."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class ModelRunner:
    def __init__(self, model: nn.Module, *, slots: int, max_len: int) -> None:
        cfg = model.config
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
            raise UnsupportedModelError(
                f"{type(model).__name__}: expected a causal LM with .model.layers and .lm_head (Llama/Qwen2 layout)"
            )
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) and window < max_len:
            raise UnsupportedModelError(
                f"sliding-window attention ({window} tokens) is not supported; set engine.max_seq_len <= {window}"
            )
        self.model = model
        self.decoder = decoder
        attn = decoder.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.gqa = self.kv_heads != self.num_heads
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.kv = SlotKVCache(
            layers=len(decoder.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            slots=slots,
            max_len=max_len,
            dtype=self.dtype,
            device=self.device,
        )

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, make_attend) -> torch.Tensor:
        """Decoder layers over ``input_ids`` [b, s]; ``make_attend(layer)`` returns the function that
        stores the new K/V and computes attention for that layer. Returns hidden states [b, s, hidden]."""
        h = self.decoder.embed_tokens(input_ids)
        cos, sin = self.decoder.rotary_emb(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b, s, _ = h.shape
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, s, -1, self.head_dim)
            k = attn.k_proj(x).view(b, s, -1, self.head_dim)
            v = attn.v_proj(x).view(b, s, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = _rope(q.transpose(1, 2), cos, sin)
            k = _rope(k.transpose(1, 2), cos, sin)
            out = make_attend(i)(q, k, v.transpose(1, 2))
            h = h + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    @torch.inference_mode()
    def prefill(self, items: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Prefill several sequences in one forward. Each item is (slot, token_ids, start): the tokens
        go to positions [start, start+len) of the slot, whose KV for [0, start) is already there.
        The projections and MLPs run on all tokens at once; attention runs per sequence.
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
            masks.append(None if start == 0 else (torch.arange(end, device=self.device)[None, :] <= pos[:, None]))
            offset += n
        input_ids = torch.tensor([ids], device=self.device)
        position_ids = torch.cat(positions).unsqueeze(0)

        def make_attend(layer_idx: int):
            kc, vc = self.kv.layer(layer_idx)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                outs = []
                for (slot, start, end, off), mask in zip(spans, masks):
                    n = end - start
                    kc[slot, :, start:end] = k[0, :, off : off + n]
                    vc[slot, :, start:end] = v[0, :, off : off + n]
                    outs.append(
                        F.scaled_dot_product_attention(
                            q[:, :, off : off + n],
                            kc[slot : slot + 1, :, :end],
                            vc[slot : slot + 1, :, :end],
                            attn_mask=mask,
                            is_causal=mask is None,
                            scale=self.scaling,
                            enable_gqa=self.gqa,
                        )
                    )
                return torch.cat(outs, dim=2)

            return attend

        last = torch.tensor([off + (end - start) - 1 for _, start, end, off in spans], device=self.device)
        h = self._hidden(input_ids, position_ids, make_attend)
        return self.model.lm_head(self.decoder.norm(h[0, last]))

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of the sequences in slots 0..n-1, at the given positions. Returns [n, vocab]."""
        n = len(token_ids)
        ids = torch.tensor(token_ids, device=self.device).unsqueeze(1)
        pos = torch.tensor(positions, device=self.device)
        length = int(max(positions)) + 1
        rows = torch.arange(n, device=self.device)
        mask = (torch.arange(length, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]

        def make_attend(layer_idx: int):
            kc, vc = self.kv.layer(layer_idx)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                kc[rows, :, pos] = k[:, :, 0]
                vc[rows, :, pos] = v[:, :, 0]
                return F.scaled_dot_product_attention(
                    q, kc[:n, :, :length], vc[:n, :, :length], attn_mask=mask, scale=self.scaling, enable_gqa=self.gqa
                )

            return attend

        h = self._hidden(ids, pos.unsqueeze(1), make_attend)
        return self.model.lm_head(self.decoder.norm(h[:, -1]))

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
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
