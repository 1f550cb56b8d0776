"""Packing training samples into rows: flat (the baseline) and prefix-tree (P2: shared prefixes computed once).

The members of a GRPO group share their prompt and the turns of an episode share their history.
Tree packing merges the samples of a micro-batch into the one prefix tree of the project
(``arborl.prefix.RadixTree``), lays the tree out in DFS pre-order and runs every shared token
once: each token attends to exactly its ancestors (``tree_attention``) at position id = its
depth (= its position in every sample containing it), so its hidden state, and the logits at
it, are the ones each of those samples would have computed alone.

Use::

    batch = pack(samples, mode="auto", token_budget=4096, min_saving=0.2)
    logps = packed_logprobs(model, batch)                 # list, one tensor per sample
    logps, ents = packed_logprobs(model, batch, with_entropy=True)

``logps[i][t] = log p(samples[i][t+1] | samples[i][:t+1])`` (length ``len(samples[i]) - 1``),
differentiable. Compute the loss from these per-sample tensors exactly as for flat sequences
(each sample with its own advantage, loss mask, importance weight); autograd then sums the
contributions of every sample that contains a shared token into that token's gradient, which
is the "loss coefficient = sum over samples" of tree packing: loss and all gradients equal
those of flat packing (tests/test_packing.py checks this to 1e-5 in float64).

Rows: the tree (or the flat samples, one after another) cut into rows of at most
``token_budget`` tokens. A tree that does not fit is split at node boundaries: a subtree that
does not fit in the current row starts a new row that first repeats its ancestors' path (those
repeated tokens are counted in ``tokens_packed``). A row is longer than the budget only when
one sample (with its path) alone is. Everything in a ``PackedBatch`` runs in one forward, so the
trainer bounds memory by what it passes to one ``pack`` call (its micro-batch).

``mode="auto"`` packs as a tree unless ``1 - tokens_packed(tree) / tokens_flat < min_saving``
(the tree would save too little to pay for its mask), then flat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import nn

from arborl.models.forward import DecoderShape, decoder_hidden
from arborl.prefix import RadixNode, RadixTree
from arborl.train.head_logprobs import head_logprobs
from arborl.train.tree_attention import (
    Backend,
    block_plan,
    blocks_attend,
    dense_attend,
    flex_attend,
    resolve_backend,
)

Mode = Literal["flat", "tree", "auto"]
DEFAULT_BLOCK_SIZE = 128  # query/key block of the CPU "blocks" attention backend


@dataclass(eq=False)
class PackedBatch:
    """Samples packed into rows; all index tensors live on the CPU (moved at forward time).

    The rows are concatenated into one sequence of ``tokens_packed`` tokens; row ``r`` is
    ``[row_offsets[r], row_offsets[r + 1])``.
    """

    mode: Literal["flat", "tree"]
    input_ids: torch.Tensor  # [tokens_packed] long
    position_ids: torch.Tensor  # [tokens_packed] long: depth in the tree = position in the sample
    vis_end: torch.Tensor  # [tokens_packed] long: key j is seen by queries j <= q < vis_end[j]
    row_offsets: list[int]
    sample_lengths: list[int]
    token_pos: torch.Tensor  # [tokens_flat] packed position of every sample token, samples in order
    logit_pos: torch.Tensor  # [P] packed positions whose next-token distribution is needed
    pair_logit: torch.Tensor  # [T] row of logit_pos for each (sample, t), samples in order
    pair_target: torch.Tensor  # [T] token samples[i][t + 1]
    tokens_flat: int  # sum of sample lengths: what flat packing computes
    tokens_tree: int  # distinct prefix-tree tokens (= tokens_flat for flat packing)
    _plans: dict[int, list] = field(default_factory=dict, repr=False)

    @property
    def tokens_packed(self) -> int:
        """Tokens the forward computes (tree tokens + repeated ancestor paths of split rows)."""
        return int(self.input_ids.shape[0])

    @property
    def rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def row_lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.row_offsets, self.row_offsets[1:])]

    @property
    def saving(self) -> float:
        """1 - tokens_packed / tokens_flat (0 for flat packing)."""
        return 1.0 - self.tokens_packed / self.tokens_flat if self.tokens_flat else 0.0

    @property
    def num_samples(self) -> int:
        return len(self.sample_lengths)


# --------------------------------------------------------------------------- building rows


class _Layout:
    """Rows under construction: tokens, depths, visibility ends, row boundaries."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.end: list[int] = []
        self.row_offsets: list[int] = [0]

    @property
    def n(self) -> int:
        return len(self.ids)

    def add(self, tokens: Sequence[int], depth0: int) -> int:
        start = len(self.ids)
        self.ids.extend(tokens)
        self.pos.extend(range(depth0, depth0 + len(tokens)))
        self.end.extend([-1] * len(tokens))  # set when the span closes
        return start

    def close_span(self, start: int, stop: int, end: int) -> None:
        self.end[start:stop] = [end] * (stop - start)

    def close_row(self) -> None:
        if self.n > self.row_offsets[-1]:
            self.row_offsets.append(self.n)


def _flat_layout(samples: list[list[int]], budget: int) -> tuple[_Layout, list[list[int]]]:
    lay = _Layout()
    positions: list[list[int]] = []
    for s in samples:
        if lay.n - lay.row_offsets[-1] + len(s) > budget:
            lay.close_row()
        start = lay.add(s, 0)
        lay.close_span(start, lay.n, lay.n)
        positions.append(list(range(start, lay.n)))
    lay.close_row()
    return lay, positions


def _tree_layout(samples: list[list[int]], budget: int,
                 tree: RadixTree[None] | None = None) -> tuple[_Layout, list[list[int]], int]:
    if tree is None:
        tree = RadixTree()
        for s in samples:
            if s:
                tree.insert(s)
    lay = _Layout()
    # where each node sits in the current row (node id -> packed start), original or repeated
    where: dict[int, int] = {}
    own_row: dict[int, dict[int, int]] = {}  # end node id -> the row's `where` it was placed in
    stack: list[tuple[RadixNode[None], int]] = []  # open path of the current row: (node, start)

    def pop_to(parent: RadixNode[None] | None) -> None:
        while stack and stack[-1][0] is not parent:
            node, start = stack.pop()
            lay.close_span(start, start + len(node.tokens), lay.n)

    def place(node: RadixNode[None]) -> None:
        start = lay.add(node.tokens, node.start)
        where[id(node)] = start
        own_row[id(node)] = where
        stack.append((node, start))

    for node in tree.dfs():
        parent = node.parent if node.parent is not tree.root else None
        pop_to(parent)
        row_len = lay.n - lay.row_offsets[-1]
        if row_len + len(node.tokens) > budget and row_len > node.start:
            # does not fit, and a fresh row (its ancestors' path + it) is shorter: start one
            pop_to(None)
            lay.close_row()
            where = {}
            path: list[RadixNode[None]] = []
            a = parent
            while a is not None:
                path.append(a)
                a = a.parent if a.parent is not tree.root else None
            for a in reversed(path):
                start = lay.add(a.tokens, a.start)
                where[id(a)] = start
                stack.append((a, start))
        place(node)
    pop_to(None)
    lay.close_row()

    positions: list[list[int]] = []
    for s in samples:
        if not s:
            positions.append([])
            continue
        nodes = tree.match_prefix(s).nodes
        row = own_row[id(nodes[-1])]
        pos: list[int] = []
        for nd in nodes:
            b = row[id(nd)]
            pos.extend(range(b, b + len(nd.tokens)))
        positions.append(pos)
    return lay, positions, tree.total_tokens


def pack(
    samples: Sequence[Sequence[int]],
    *,
    mode: Mode = "auto",
    token_budget: int = 4096,
    min_saving: float = 0.2,
    tree: RadixTree[None] | None = None,
) -> PackedBatch:
    """Pack token-id sequences for one forward; see the module docstring. ``tree``: the prefix tree of
    exactly these samples where the caller already built one (the trainer does, sizing its micro-batches),
    used instead of building it again."""
    if mode not in ("flat", "tree", "auto"):
        raise ValueError(f"mode must be flat, tree or auto, got {mode!r}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    samples = [[int(t) for t in s] for s in samples]
    if not samples:
        raise ValueError("pack() needs at least one sample")
    tokens_flat = sum(len(s) for s in samples)
    tokens_tree = tokens_flat
    chosen: Literal["flat", "tree"] = "flat"
    if mode != "flat":
        lay, positions, tokens_tree = _tree_layout(samples, token_budget, tree)
        chosen = "tree"
        if mode == "auto" and tokens_flat and 1.0 - lay.n / tokens_flat < min_saving:
            chosen = "flat"
            tokens_tree = tokens_flat
    if chosen == "flat":
        lay, positions = _flat_layout(samples, token_budget)

    # next-token pairs: sample token t (at its packed position) predicts sample token t + 1
    src = [p for s_pos in positions for p in s_pos[:-1]]
    tgt = [t for s in samples for t in s[1:]]
    src_t = torch.tensor(src, dtype=torch.long)
    logit_pos, pair_logit = torch.unique(src_t, sorted=True, return_inverse=True)
    return PackedBatch(
        mode=chosen,
        input_ids=torch.tensor(lay.ids, dtype=torch.long),
        position_ids=torch.tensor(lay.pos, dtype=torch.long),
        vis_end=torch.tensor(lay.end, dtype=torch.long),
        row_offsets=lay.row_offsets,
        sample_lengths=[len(s) for s in samples],
        token_pos=torch.tensor([p for s_pos in positions for p in s_pos], dtype=torch.long),
        logit_pos=logit_pos,
        pair_logit=pair_logit.view(-1),
        pair_target=torch.tensor(tgt, dtype=torch.long),
        tokens_flat=tokens_flat,
        tokens_tree=tokens_tree,
    )


# --------------------------------------------------------------------------- forward


def _padded_rows(batch: PackedBatch, device: torch.device, multiple: int = 1):
    """Rows as a padded batch [rows, L] (L rounded up to ``multiple``); pads see only themselves.
    Returns ids, pos, end, real (flat indices of the real tokens in the [rows * L] layout, in
    packed order)."""
    lengths = batch.row_lengths
    R, L = len(lengths), -(-max(lengths) // multiple) * multiple
    ids = torch.zeros(R, L, dtype=torch.long)
    pos = torch.zeros(R, L, dtype=torch.long)
    end = torch.arange(1, L + 1).repeat(R, 1)
    real = []
    for r, (a, b) in enumerate(zip(batch.row_offsets, batch.row_offsets[1:])):
        ids[r, : b - a] = batch.input_ids[a:b]
        pos[r, : b - a] = batch.position_ids[a:b]
        end[r, : b - a] = batch.vis_end[a:b] - a
        real.append(torch.arange(r * L, r * L + b - a))
    return ids.to(device), pos.to(device), end.to(device), torch.cat(real).to(device)


@overload
def packed_logprobs(
    model: nn.Module, batch: PackedBatch, *, with_entropy: Literal[False] = ..., attention: Backend = ...,
    block_size: int = ..., temperature: float = ..., checkpoint: bool = ..., logits_chunk: int = ...,
    trim_heap: bool = ...,
) -> list[torch.Tensor]: ...
@overload
def packed_logprobs(
    model: nn.Module, batch: PackedBatch, *, with_entropy: Literal[True], attention: Backend = ...,
    block_size: int = ..., temperature: float = ..., checkpoint: bool = ..., logits_chunk: int = ...,
    trim_heap: bool = ...,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...


def packed_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    *,
    with_entropy: bool = False,
    attention: Backend = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    temperature: float = 1.0,
    checkpoint: bool | int = False,
    logits_chunk: int = 0,
    trim_heap: bool = False,
):
    """Per-sample next-token log-probs (and entropies) of ``batch`` under ``model``.

    Returns a list with one tensor per sample, ``len(sample) - 1`` long (empty for samples of
    length 0 or 1): entry ``t`` is ``log p(s[t+1] | s[:t+1])``; with ``with_entropy`` also the
    entropy of the same next-token distribution, aligned the same way. Both differentiable,
    float32 at least (float64 for a float64 model). Every packed position's logits are computed
    once, however many samples share it.

    ``temperature``: log-probs of softmax(logits / temperature), the distribution a sampler at
    that temperature draws from (train the policy you sample from).

    ``attention``: ``auto`` (flex_attention where it runs forward and backward, i.e. CUDA;
    else ``blocks``), ``blocks`` (block-sparse SDPA over one concatenated sequence; the CPU
    default), ``dense`` (padded rows, dense mask; reference) or ``flex``.

    ``checkpoint``: activation checkpointing per decoder layer (``decoder_hidden``; True = every layer, an int
    the first that many); same gradients.

    ``trim_heap``: the C heap's free pages go back to the system after each decoder layer (``decoder_hidden``).

    ``logits_chunk``: the LM head's logits of at most this many positions exist at once, forward and
    backward (``train/head_logprobs.py``; 0 = all positions' at once); same values and gradients.
    """
    param = next(model.parameters())
    device = param.device
    shape = DecoderShape.of(model)
    scale, gqa = shape.scaling, shape.gqa
    splits = [max(n - 1, 0) for n in batch.sample_lengths]
    backend = resolve_backend(attention, device)
    if batch.logit_pos.numel() == 0:  # no sample has two tokens: nothing to predict
        out_dtype = torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype
        empty = [param.reshape(-1)[:0].to(out_dtype) for _ in splits]  # in the graph, zero gradient
        return (empty, list(empty)) if with_entropy else empty
    if backend == "blocks":
        plan = batch._plans.get(block_size)
        if plan is None:
            plan = batch._plans[block_size] = block_plan(batch.vis_end, block_size)
        attend = blocks_attend(plan, scale, gqa, device)
        hidden = decoder_hidden(
            model, batch.input_ids.to(device)[None], batch.position_ids.to(device)[None], lambda _: attend,
            checkpoint=checkpoint, trim_heap=trim_heap,
        )[0]
    else:
        # flex: a few padded lengths, so that the compiled kernel is not rebuilt for every batch
        ids, pos, end, real = _padded_rows(batch, device, 128 if backend == "flex" else 1)
        attend = dense_attend(end, scale, gqa) if backend == "dense" else flex_attend(end, scale, gqa)
        hidden = decoder_hidden(model, ids, pos, lambda _: attend, checkpoint=checkpoint, trim_heap=trim_heap)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, real)

    logp, entropy = head_logprobs(
        model, hidden.index_select(0, batch.logit_pos.to(device)), batch.pair_logit.to(device),
        batch.pair_target.to(device), chunk=logits_chunk, temperature=temperature, with_entropy=with_entropy,
    )
    out = list(torch.split(logp, splits))
    if entropy is None:
        return out
    return out, list(torch.split(entropy, splits))
