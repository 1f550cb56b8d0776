"""A radix (compressed prefix) tree over token-id sequences.

One structure serves two users:

* the inference engine's KV prefix cache: a node's ``value`` is the KV of exactly its
  edge tokens, and ``evict`` frees least-recently-used leaves (a request copies the KV it
  matched into its own slot when it is admitted, so nothing in the tree needs pinning);
* tree packing of training samples, through the deterministic ``dfs`` traversal.

Nodes are never merged back together: a node owns its value, and merging would have to
combine two.
"""

from __future__ import annotations

import heapq
import weakref
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

V = TypeVar("V")


class RadixNode(Generic[V]):
    """An edge of the tree. A node holds its parent weakly: the tree owns its nodes downwards only, so a
    tree (or subtree) that is dropped is freed at once by reference counting, values included, instead of
    waiting as a parent/child cycle for a full garbage collection (the engine's prefix cache, replaced
    at every weight update, held a whole policy version's KV that way: 0.5 GB an evaluation split)."""

    __slots__ = ("tokens", "_parent", "children", "value", "last_access", "start", "__weakref__")

    def __init__(
        self,
        tokens: tuple[int, ...] = (),
        parent: RadixNode[V] | None = None,
        value: V | None = None,
        start: int = 0,
        last_access: int = 0,
    ) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, RadixNode[V]] = {}
        self.value = value
        self.last_access = last_access
        self.start = start

    @property
    def parent(self) -> RadixNode[V] | None:
        return self._parent() if self._parent is not None else None

    @parent.setter
    def parent(self, node: RadixNode[V] | None) -> None:
        self._parent = weakref.ref(node) if node is not None else None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (
            f"RadixNode(start={self.start}, tokens={self.tokens!r}, children={len(self.children)}, "
            f"last_access={self.last_access})"
        )


@dataclass
class PrefixMatch(Generic[V]):
    length: int
    nodes: list[RadixNode[V]]
    last_node_tokens: int


def _common_length(edge: tuple[int, ...], tokens: Sequence[int], offset: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[offset:]``."""
    n = min(len(edge), len(tokens) - offset)
    i = 0
    while i < n and edge[i] == tokens[offset + i]:
        i += 1
    return i


class RadixTree(Generic[V]):
    def __init__(self, split_value: Callable[[V, int], tuple[V, V]] | None = None) -> None:
        self.split_value = split_value
        self.root: RadixNode[V] = RadixNode()
        self._clock = 0
        self._num_nodes = 0
        self._total_tokens = 0

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    def __len__(self) -> int:
        return self._num_nodes

    def __contains__(self, tokens: object) -> bool:
        if not isinstance(tokens, Sequence):
            return False
        seq = cast("Sequence[int]", tokens)
        node, i = self.root, 0
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                return False
            c = _common_length(child.tokens, seq, i)
            if c < len(child.tokens):
                return i + c == len(seq)
            node, i = child, i + c
        return True

    def insert(
        self, tokens: Sequence[int], value_for: Callable[[int, int], V] | None = None
    ) -> RadixNode[V]:
        self._clock += 1
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                value = value_for(i, len(tokens)) if value_for is not None else None
                new = RadixNode(tuple(tokens[i:]), node, value, i, self._clock)
                node.children[tokens[i]] = new
                self._num_nodes += 1
                self._total_tokens += len(new.tokens)
                return new
            c = _common_length(child.tokens, tokens, i)
            if c < len(child.tokens):
                child = self._split(child, c)
            child.last_access = self._clock
            node, i = child, i + c
        return node

    def match_prefix(self, tokens: Sequence[int], *, split: bool = False) -> PrefixMatch[V]:
        self._clock += 1
        nodes: list[RadixNode[V]] = []
        node, i, last = self.root, 0, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            c = _common_length(child.tokens, tokens, i)
            if c < len(child.tokens) and split:
                child = self._split(child, c)
            child.last_access = self._clock
            nodes.append(child)
            node, i, last = child, i + c, c
            if c < len(child.tokens):
                break
        return PrefixMatch(i, nodes, last)

    def evict(
        self, num_tokens: int, on_evict: Callable[[RadixNode[V]], None] | None = None
    ) -> int:
        if num_tokens <= 0:
            return 0
        tiebreak = itertools.count()
        heap = [(n.last_access, next(tiebreak), n) for n in self.dfs() if n.is_leaf]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            # on_evict may have touched the tree; skip entries that stopped being evictable.
            if parent is None or not node.is_leaf:
                continue
            if on_evict is not None:
                on_evict(node)
            del parent.children[node.tokens[0]]
            self._num_nodes -= 1
            self._total_tokens -= len(node.tokens)
            freed += len(node.tokens)
            if parent.parent is not None and parent.is_leaf:
                heapq.heappush(heap, (parent.last_access, next(tiebreak), parent))
        return freed

    def dfs(self) -> Iterator[RadixNode[V]]:
        stack = sorted(self.root.children.items(), reverse=True)
        while stack:
            _, node = stack.pop()
            yield node
            stack.extend(sorted(node.children.items(), reverse=True))

    def sequences(self) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for leaf in self.dfs():
            if leaf.children:
                continue
            parts: list[tuple[int, ...]] = []
            node: RadixNode[V] | None = leaf
            while node is not None:
                parts.append(node.tokens)
                node = node.parent
            out.append(tuple(itertools.chain.from_iterable(reversed(parts))))
        return sorted(out)

    def _split(self, node: RadixNode[V], k: int) -> RadixNode[V]:
        """Cut ``node``'s edge after ``k`` tokens; return the new upper part.

        The original object stays the lower part so that outside references to it keep
        pointing at the deepest node they covered.
        """
        assert node.parent is not None and 0 < k < len(node.tokens)
        if node.value is None:
            head_value, tail_value = None, None
        elif self.split_value is None:
            raise ValueError("splitting a node that holds a value needs RadixTree(split_value=...)")
        else:
            head_value, tail_value = self.split_value(node.value, k)
        head = RadixNode(node.tokens[:k], node.parent, head_value, node.start, node.last_access)
        head.children[node.tokens[k]] = node
        node.parent.children[node.tokens[0]] = head
        node.tokens = node.tokens[k:]
        node.start += k
        node.parent = head
        node.value = tail_value
        self._num_nodes += 1
        return head
