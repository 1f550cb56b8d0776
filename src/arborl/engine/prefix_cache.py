"""Radix prefix cache (P1): KV of finished and prefilled sequences, keyed by their token ids.

Each node of the one prefix tree (``arborl.prefix``) holds the KV of its edge's tokens
(``[layers, 2, kv_heads, len, head_dim]``). A new prompt copies the KV of its longest cached prefix
into its slot and prefills only the rest. LRU leaves are evicted past a budget in tokens.
The cache belongs to one policy version: a weight update clears it.
"""

from __future__ import annotations

from typing import Callable

import torch

from arborl.prefix import RadixTree


def _split_kv(kv: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # clone so that evicting one half really frees its memory
    return kv[:, :, :, :k].clone(), kv[:, :, :, k:].clone()


class PrefixKVCache:
    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.tree: RadixTree[torch.Tensor] = RadixTree(split_value=_split_kv)

    @property
    def cached_tokens(self) -> int:
        return self.tree.total_tokens

    def lookup(self, tokens: list[int]) -> list[tuple[int, torch.Tensor]]:
        """(start position, KV piece) pairs covering the longest cached prefix of ``tokens``."""
        match = self.tree.match_prefix(tokens)
        pieces = []
        for i, node in enumerate(match.nodes):
            kv = node.value
            assert kv is not None
            if i == len(match.nodes) - 1 and match.last_node_tokens < len(node.tokens):
                kv = kv[:, :, :, : match.last_node_tokens]
            pieces.append((node.start, kv))
        return pieces

    def insert(self, tokens: list[int], read_kv: Callable[[int, int], torch.Tensor]) -> None:
        """Cache the KV of ``tokens``; ``read_kv(start, end)`` returns the KV of that span."""
        if self.budget_tokens <= 0 or not tokens:
            return
        self.tree.insert(tokens, value_for=read_kv)
        excess = self.tree.total_tokens - self.budget_tokens
        if excess > 0:
            self.tree.evict(excess)

    def prefix_kv(self, tokens: list[int]) -> torch.Tensor | None:
        """The KV of the longest cached prefix of ``tokens`` as one tensor (None when nothing is cached):
        what one engine exports to another."""
        pieces = self.lookup(tokens)
        return torch.cat([kv for _, kv in pieces], dim=3) if pieces else None

    def insert_kv(self, tokens: list[int], kv: torch.Tensor) -> int:
        """Cache ``kv`` (``[layers, 2, kv_heads, n, head_dim]``, from another engine) as the KV of
        ``tokens[:n]``; returns how many of those tokens the cache holds now."""
        n = min(kv.shape[3], len(tokens))
        self.insert(tokens[:n], lambda a, b: kv[:, :, :, a:b].clone())
        return sum(piece.shape[3] for _, piece in self.lookup(tokens[:n]))

    def nbytes(self) -> int:
        """Bytes of the cached KV."""
        return sum(node.value.nbytes for node in self.tree.dfs() if node.value is not None)

    def clear(self) -> None:
        self.tree = RadixTree(split_value=_split_kv)
