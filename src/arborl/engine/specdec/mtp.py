"""The ``mtp`` drafter (I2): a multi-token-prediction head on the policy (DeepSeek-V3's MTP module).

At position i the head reads the policy's last hidden state h_{i-1} (before the final norm, the row
that predicted token t_i) and the embedding of t_i, and predicts t_{i+1}:

    x_i = W [RMSNorm_h(h_{i-1}); RMSNorm_e(embed(t_i))]      W: [hidden, 2 hidden]
    o_i = DecoderLayer(x_i)   (causal attention over the head's own earlier positions)
    p(t_{i+1}) = softmax(lm_head(norm(o_i)))                 embed, norm, lm_head: the policy's, shared

Drafting k tokens runs the head autoregressively: draft j + 1 is predicted from (o of draft j,
embed(draft j)). The decoder layer starts as a copy of the policy's last layer, W as [I/2, I/2].

The engine hands the drafter, after every decode or verify step, the hidden rows that produced each
sequence's new tokens (``observe``); the head's context is the run of positions observed since the
sequence's first decode step (prefill rows are not observed, and a weight update restarts it).
``train/mtp.py`` trains the head on exactly that context. The head's KV is per sequence; draft
positions past the observed ones are overwritten by the next step.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from arborl.engine.sequence import Sequence
from arborl.engine.specdec.draft import Draft
from arborl.engine.specdec.drafter import DRAFTERS, EngineView
from arborl.models.forward import lm_logits
from arborl.types import ArborlError

if TYPE_CHECKING:
    from arborl.config import Config

PREFIX = "mtp."  # the head's tensors in a published weights dict: mtp.<name in MTPHead.state_dict()>
MTP_FILE = "mtp.safetensors"  # the head in a checkpoint / export directory, beside the policy's HF files
MAX_DRAFT = 32  # engine.spec.num_tokens' upper bound: KV room for draft positions past max_seq_len


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MTPHead(nn.Module):
    """The head's own weights (``state_dict`` holds only these); the policy's embeddings, rotary
    embedding, final norm and LM head are used, not owned, so a policy update reaches them at once."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        decoder = policy.model
        hidden = decoder.embed_tokens.weight.shape[1]
        self.hnorm = copy.deepcopy(decoder.norm)
        self.enorm = copy.deepcopy(decoder.norm)
        w = decoder.norm.weight
        self.eh_proj = nn.utils.skip_init(nn.Linear, 2 * hidden, hidden, bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():  # deterministic, so the trainer's copy and every engine's start equal
            eye = torch.eye(hidden, device=w.device, dtype=w.dtype) * 0.5
            self.eh_proj.weight.copy_(torch.cat([eye, eye], dim=1))
        self.layer = copy.deepcopy(decoder.layers[-1])
        self._policy = [policy]  # a list: not a submodule

    @property
    def policy(self) -> nn.Module:
        return self._policy[0]

    def hidden(self, h_prev: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        """o [b, s, hidden] for inputs h_prev [b, s, hidden], token_ids [b, s] at position_ids [b, s];
        ``attend(q, k, v)`` (heads-first tensors) does the attention (and keeps the KV)."""
        decoder = self.policy.model
        e = decoder.embed_tokens(token_ids)
        x = self.eh_proj(torch.cat([self.hnorm(h_prev.to(e.dtype)), self.enorm(e)], dim=-1))
        cos, sin = decoder.rotary_emb(x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        layer, attn = self.layer, self.layer.self_attn
        b, s, _ = x.shape
        y = layer.input_layernorm(x)
        q = attn.q_proj(y).view(b, s, -1, attn.head_dim)
        k = attn.k_proj(y).view(b, s, -1, attn.head_dim)
        v = attn.v_proj(y).view(b, s, -1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.transpose(1, 2) * cos + _rotate_half(q.transpose(1, 2)) * sin
        k = k.transpose(1, 2) * cos + _rotate_half(k.transpose(1, 2)) * sin
        out = attend(q, k, v.transpose(1, 2))
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return self.policy.lm_head(self.policy.model.norm(o))

    def causal(self, h_prev: torch.Tensor, token_ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [s, vocab] of one context run: h_prev [s, hidden] and token_ids [s] at positions
        start, start + 1, ... (plain causal attention over the run: what the drafter sees)."""
        attn = self.layer.self_attn
        pos = torch.arange(start, start + len(token_ids), device=token_ids.device)[None]
        gqa = self.policy.config.num_attention_heads != (getattr(self.policy.config, "num_key_value_heads", None)
                                                         or self.policy.config.num_attention_heads)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=gqa)

        return self.logits(self.hidden(h_prev[None], token_ids[None], pos, attend))[0]


def head_state(head: MTPHead) -> dict[str, torch.Tensor]:
    """The head's tensors as they travel with the policy weights (``mtp.`` names, detached copies)."""
    return {PREFIX + k: v.detach().clone() for k, v in head.state_dict().items()}


def load_head_state(head: MTPHead, state: dict[str, torch.Tensor]) -> None:
    """Load ``mtp.``-prefixed (or bare) tensors into ``head``; every tensor of the head must be there."""
    own = {k.removeprefix(PREFIX): v for k, v in state.items()}
    mine = head.state_dict()
    missing, unexpected = sorted(set(mine) - set(own)), sorted(set(own) - set(mine))
    wrong = [k for k in set(mine) & set(own) if mine[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise ArborlError(f"MTP head weights do not fit the policy: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                          f"other shape {wrong[:3]} (a head trained for another model?)")
    head.load_state_dict(own)


def save_head(head: MTPHead, path: str | Path) -> None:
    """The head's ``mtp.*`` tensors to ``path``: safetensors when it ends in .safetensors, else torch.save."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        safetensors.torch.save_file({k: v.contiguous() for k, v in head_state(head).items()}, str(path))
    else:
        torch.save(head_state(head), path)


def load_head(head: MTPHead, path: str | Path) -> None:
    """Head weights from ``path``: a file ``save_head`` wrote, or a directory holding ``MTP_FILE`` (a
    checkpoint, an ``arborl export``)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / MTP_FILE
    if not path.is_file():
        raise ArborlError(f"engine.spec.mtp_path: no MTP head weights at {path}")
    if path.suffix == ".safetensors":
        state = safetensors.torch.load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    load_head_state(head, {k: v.to(next(head.parameters()).device) for k, v in state.items()})


def mtp_init_path(cfg: "Config") -> str | None:
    """The head the mtp drafter and its trainer start from: ``engine.spec.mtp_path``, else the head
    beside the policy's Hugging Face directory (``model.path``/``MTP_FILE``, which a checkpoint and
    ``arborl export`` hold), else None (the deterministic init from the policy's last layer)."""
    if cfg.engine.spec.mtp_path:
        return cfg.engine.spec.mtp_path
    if cfg.model.source == "hf" and cfg.model.path and (Path(cfg.model.path).expanduser() / MTP_FILE).is_file():
        return str(Path(cfg.model.path).expanduser() / MTP_FILE)
    return None


class _Context:
    """One sequence's head context: KV for positions [lo, end) and the observed rows not yet run."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.lo = self.end = 0
        self.pending: list[tuple[torch.Tensor, int]] = []  # (h_prev row, token) at positions end, end + 1, ...

    def add(self, rows: torch.Tensor, tokens: list[int], first_pos: int) -> None:
        if first_pos != self.end + len(self.pending):  # a gap (first step, weight update): start over here
            self.lo = self.end = first_pos
            self.pending = []
        self.pending += list(zip(rows, tokens))


class MTPDrafter:
    def __init__(self, engine: EngineView, head: MTPHead | None = None) -> None:
        cfg = engine.config
        self.head = (head if head is not None else MTPHead(engine.model)).eval()
        if head is None and cfg.spec.mtp_path:
            load_head(self.head, cfg.spec.mtp_path)
        attn = self.head.layer.self_attn
        pc = engine.model.config
        kv_heads = getattr(pc, "num_key_value_heads", None) or pc.num_attention_heads
        self.gqa = kv_heads != pc.num_attention_heads
        self.scaling = attn.scaling
        self.max_len = cfg.max_seq_len + MAX_DRAFT
        p = self.head.eh_proj.weight
        self._kv_shape = (2, cfg.max_batch_size, kv_heads)  # then [positions, head_dim]
        self._head_dim = attn.head_dim
        self.kv = torch.zeros(*self._kv_shape, min(256, self.max_len), attn.head_dim, dtype=p.dtype, device=p.device)
        self._free = list(range(cfg.max_batch_size - 1, -1, -1))
        self._linear = getattr(engine.runner, "linear", None)  # the engine's prepacked LM head, where it has one
        self._ctx: dict[str, _Context] = {}

    # -- the engine's calls -------------------------------------------------------------------------
    def sync(self, seq: Sequence) -> None:
        if seq.request_id not in self._ctx:
            self._ctx[seq.request_id] = _Context(self._free.pop())

    def observe(self, seq: Sequence, rows: torch.Tensor) -> None:
        """``rows`` [m, hidden]: the policy's hidden rows that produced the last m tokens of ``seq``."""
        ctx = self._ctx.get(seq.request_id)
        if ctx is None or seq.slot < 0:
            return
        m = rows.shape[0]
        ctx.add(rows.detach(), seq.tokens[-m:], len(seq.tokens) - m)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[Draft]:
        out = [Draft() for _ in seqs]
        live = [i for i, s in enumerate(seqs) if self._ctx[s.request_id].pending and k > 0]
        if not live:
            return out
        ctxs = [self._ctx[seqs[i].request_id] for i in live]
        # catch up on what was observed (the policy's hidden rows), then draft on the head's own
        o = self._run([(c, torch.stack([h for h, _ in c.pending]), [t for _, t in c.pending], c.end) for c in ctxs])
        for c in ctxs:
            c.end += len(c.pending)
            c.pending = []
        drafted = [[t] for t in self._logits(o).argmax(-1).tolist()]
        ends = [c.end for c in ctxs]
        for j in range(1, k):
            o = self._run([(c, o[r : r + 1], [d[-1]], e + j - 1) for r, (c, d, e) in enumerate(zip(ctxs, drafted, ends))])
            for d, t in zip(drafted, self._logits(o).argmax(-1).tolist()):
                d.append(t)
        for i, d in zip(live, drafted):
            out[i] = Draft.chain(d)
        return out

    def release(self, seq: Sequence) -> None:
        ctx = self._ctx.pop(seq.request_id, None)
        if ctx is not None:
            self._free.append(ctx.slot)

    def weights_updated(self) -> None:
        for ctx in self._ctx.values():  # the context's KV belongs to the old policy's hidden states
            ctx.lo = ctx.end = 0
            ctx.pending = []

    def load_head(self, state: dict[str, torch.Tensor]) -> None:
        """New head weights (published with the policy's); contexts restart as after a weight update."""
        load_head_state(self.head, state)
        self.weights_updated()

    # -- the head's forward over its KV ---------------------------------------------------------------
    def _logits(self, o: torch.Tensor) -> torch.Tensor:
        return lm_logits(self.head.policy, o, self._linear)

    def _ensure(self, length: int) -> None:
        cap = self.kv.shape[-2]
        if length <= cap:
            return
        new = torch.zeros(*self._kv_shape, min(self.max_len, max(length, 2 * cap)), self._head_dim, dtype=self.kv.dtype,
                          device=self.kv.device)
        new[..., :cap, :] = self.kv
        self.kv = new

    def _run(self, items: list[tuple[_Context, torch.Tensor, list[int], int]]) -> torch.Tensor:
        """Each item: (context, h_prev [m, hidden], tokens [m], first position); the rows go to the
        context's KV at positions first .. first + m - 1 and attend to [lo, their own position].
        Returns the head's output o of each item's last row, [len(items), hidden]."""
        b = len(items)
        width = max(len(t) for _, _, t, _ in items)
        length = max(p + len(t) for _, _, t, p in items)
        self._ensure(length)
        dev = self.kv.device
        hidden = items[0][1].shape[-1]
        h = torch.zeros(b, width, hidden, dtype=items[0][1].dtype, device=dev)
        ids = torch.zeros(b, width, dtype=torch.long, device=dev)
        pos = torch.zeros(b, width, dtype=torch.long, device=dev)
        mask = torch.zeros(b, 1, width, length, dtype=torch.bool, device=dev)
        rows, cols, slots, wpos, last = [], [], [], [], []
        cols_range = torch.arange(length, device=dev)
        for r, (ctx, hp, toks, first) in enumerate(items):
            m = len(toks)
            h[r, :m] = hp
            ids[r, :m] = torch.tensor(toks, device=dev)
            p = torch.arange(first, first + m, device=dev)
            pos[r, :m] = p
            pos[r, m:] = first + m - 1
            mask[r, 0, :m] = (cols_range[None] >= ctx.lo) & (cols_range[None] <= p[:, None])
            mask[r, 0, m:] = mask[r, 0, m - 1]  # padding rows: any valid row (no all-masked row: NaN)
            rows += [r] * m
            cols += range(m)
            slots += [ctx.slot] * m
            wpos += range(first, first + m)
            last.append(m - 1)
        rows_t, cols_t = torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
        slots_t, wpos_t = torch.tensor(slots, device=dev), torch.tensor(wpos, device=dev)
        gather = torch.tensor([c.slot for c, _, _, _ in items], device=dev)
        kc, vc = self.kv[0], self.kv[1]

        def attend(q, k, v):
            kc[slots_t, :, wpos_t] = k[rows_t, :, cols_t]
            vc[slots_t, :, wpos_t] = v[rows_t, :, cols_t]
            return F.scaled_dot_product_attention(q, kc[gather, :, :length], vc[gather, :, :length], attn_mask=mask,
                                                  scale=self.scaling, enable_gqa=self.gqa)

        o = self.head.hidden(h, ids, pos, attend)
        return o[torch.arange(b, device=dev), torch.tensor(last, device=dev)]


@DRAFTERS.register("mtp")
def make_mtp_drafter(engine: EngineView) -> MTPDrafter:
    return MTPDrafter(engine)
