"""RadixTree against a naive reference: a plain list of the inserted sequences."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborl.prefix import PrefixMatch, RadixNode, RadixTree

Seq = tuple[int, ...]
# A value is the (position, token) pairs of its edge: what a KV slice is to the cache.
Value = tuple[tuple[int, int], ...]

seqs = st.lists(st.integers(0, 3), max_size=8).map(tuple)
seq_lists = st.lists(seqs, max_size=12)
SETTINGS = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------- the naive reference


def lcp(a: Seq, b: Seq) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def naive_match(stored: list[Seq], q: Seq) -> int:
    return max((lcp(s, q) for s in stored), default=0)


def naive_prefixes(stored: list[Seq]) -> set[Seq]:
    return {s[:i] for s in stored for i in range(1, len(s) + 1)}


def naive_maximal(stored: list[Seq]) -> list[Seq]:
    prefixes = naive_prefixes(stored)
    return sorted(p for p in prefixes if not any(p + (t,) in prefixes for t in range(4)))


def naive_node_count(stored: list[Seq]) -> int:
    """Nodes of the compressed trie: an edge ends at a stored sequence or a branching point."""
    prefixes = naive_prefixes(stored)
    ends = set(stored)
    branching = {p for p in prefixes if sum(p + (t,) in prefixes for t in range(4)) >= 2}
    return len((ends | branching) & prefixes)


# ---------------------------------------------------------------- helpers


def value_for(tokens: Seq):
    return lambda start, end: tuple((i, tokens[i]) for i in range(start, end))


def split_value(value: Value, k: int) -> tuple[Value, Value]:
    return value[:k], value[k:]


def new_tree() -> RadixTree[Value]:
    return RadixTree(split_value=split_value)


def path_tokens(node: RadixNode) -> Seq:
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def check_invariants(tree: RadixTree) -> None:
    nodes = list(tree.dfs())
    assert len(tree) == len(nodes)
    assert tree.total_tokens == sum(len(n.tokens) for n in nodes)
    assert tree.root.tokens == () and tree.root.is_root and tree.root.start == 0
    for n in nodes:
        assert n.tokens and not n.is_root
        assert n.parent is not None and n.parent.children[n.tokens[0]] is n
        assert n.start == n.parent.end
        assert n.end == len(path_tokens(n))
        for key, child in n.children.items():
            assert key == child.tokens[0]
            assert child.last_access <= n.last_access
        if n.value is not None:
            assert n.value == tuple(zip(range(n.start, n.end), n.tokens))


def matched_values(m: PrefixMatch) -> Value:
    out: list[tuple[int, int]] = []
    for node in m.nodes[:-1]:
        out.extend(node.value)
    if m.nodes:
        out.extend(m.nodes[-1].value[: m.last_node_tokens])
    return tuple(out)


def build(stored: list[Seq]) -> RadixTree[Value]:
    tree = new_tree()
    for s in stored:
        node = tree.insert(s, value_for(s))
        assert node.end == len(s)
        assert path_tokens(node) == s
    return tree


# ---------------------------------------------------------------- properties


@SETTINGS
@given(seq_lists, st.lists(seqs, max_size=8))
def test_matches_naive_reference(stored: list[Seq], queries: list[Seq]) -> None:
    tree = build(stored)
    check_invariants(tree)
    assert tree.sequences() == naive_maximal(stored)
    assert tree.total_tokens == len(naive_prefixes(stored))
    assert len(tree) == naive_node_count(stored)
    for q in queries + stored:
        m = tree.match_prefix(q)
        assert m.length == naive_match(stored, q)
        assert sum(len(n.tokens) for n in m.nodes[:-1]) + m.last_node_tokens == m.length
        assert matched_values(m) == tuple(enumerate(q[: m.length]))
        assert (q in tree) == (naive_match(stored, q) == len(q))
        assert (q[: m.length] in tree)
    # A plain match never changes the shape.
    assert len(tree) == naive_node_count(stored)


@SETTINGS
@given(st.lists(st.tuples(st.booleans(), seqs), max_size=16))
def test_interleaved_inserts_and_splitting_matches(ops: list[tuple[bool, Seq]]) -> None:
    tree = new_tree()
    stored: list[Seq] = []
    for is_insert, s in ops:
        if is_insert:
            tree.insert(s, value_for(s))
            stored.append(s)
        else:
            m = tree.match_prefix(s, split=True)
            assert m.length == naive_match(stored, s)
            if m.nodes:
                assert m.last_node_tokens == len(m.nodes[-1].tokens)
                assert m.nodes[-1].end == m.length
            assert matched_values(m) == tuple(enumerate(s[: m.length]))
        check_invariants(tree)
        assert tree.sequences() == naive_maximal(stored)
        assert tree.total_tokens == len(naive_prefixes(stored))


@SETTINGS
@given(seq_lists, st.lists(seqs, max_size=6), st.data())
def test_evict_frees_least_recently_used_leaves(stored: list[Seq], touches: list[Seq], data) -> None:
    tree = build(stored)
    for q in touches:
        tree.match_prefix(q, split=data.draw(st.booleans()))
    check_invariants(tree)

    evicted: list[RadixNode] = []

    def on_evict(node: RadixNode) -> None:
        assert all(node is not e for e in evicted)
        assert node.is_leaf and node.parent is not None
        candidates = [n for n in tree.dfs() if n.is_leaf]
        assert node.last_access == min(n.last_access for n in candidates)
        evicted.append(node)

    before = tree.total_tokens
    want = data.draw(st.integers(0, before + 2))
    freed = tree.evict(want, on_evict)

    assert freed == sum(len(n.tokens) for n in evicted)
    assert tree.total_tokens == before - freed
    if freed < want:
        assert len(tree) == 0
    elif evicted:
        assert freed - len(evicted[-1].tokens) < want  # stopped as soon as it had enough
    check_invariants(tree)
    tree.evict(tree.total_tokens + 1)
    assert len(tree) == 0 and tree.total_tokens == 0 and tree.sequences() == []


# ---------------------------------------------------------------- units


def test_empty_inputs() -> None:
    tree = new_tree()
    assert tree.insert(()) is tree.root
    assert len(tree) == 0 and tree.total_tokens == 0
    assert tree.match_prefix([]) == PrefixMatch(0, [], 0)
    assert tree.match_prefix([1, 2]) == PrefixMatch(0, [], 0)
    assert [] in tree and [1] not in tree
    assert tree.sequences() == [] and list(tree.dfs()) == []
    assert tree.evict(10) == 0
    tree.insert([1, 2], value_for((1, 2)))
    assert tree.insert([]) is tree.root
    assert tree.match_prefix([]) == PrefixMatch(0, [], 0)
    assert tree.evict(0) == 0 and len(tree) == 1


def test_insert_only_values_new_nodes() -> None:
    calls: list[tuple[int, int]] = []

    def vf(start: int, end: int) -> str:
        calls.append((start, end))
        return f"{start}:{end}"

    tree: RadixTree[str] = RadixTree(split_value=lambda v, k: (v + "a", v + "b"))
    tree.insert([1, 2, 3], vf)
    tree.insert([1, 2, 3], vf)
    assert calls == [(0, 3)]
    node = tree.insert([1, 2, 4, 5], vf)
    assert calls == [(0, 3), (2, 4)]
    assert (node.start, node.end, node.value) == (2, 4, "2:4")
    head = node.parent
    assert head is not None and head.value == "0:3a" and head.tokens == (1, 2)
    assert head.children[3].value == "0:3b" and head.children[3].start == 2
    assert tree.insert([9]).value is None


def test_match_split() -> None:
    tree = new_tree()
    leaf = tree.insert([1, 2, 3, 4], value_for((1, 2, 3, 4)))

    m = tree.match_prefix([1, 2, 9])
    assert (m.length, m.nodes, m.last_node_tokens) == (2, [leaf], 2)
    assert len(tree) == 1

    m = tree.match_prefix([1, 2, 9], split=True)
    assert m.length == 2 and m.last_node_tokens == 2 and len(m.nodes) == 1
    head = m.nodes[0]
    assert head.tokens == (1, 2) and head.value == ((0, 1), (1, 2)) and head.end == 2
    assert leaf.parent is head and leaf.tokens == (3, 4) and leaf.start == 2
    assert leaf.value == ((2, 3), (3, 4))
    assert len(tree) == 2 and tree.total_tokens == 4
    assert tree.sequences() == [(1, 2, 3, 4)]

    # A match that ends on a boundary splits nothing.
    m = tree.match_prefix([1, 2], split=True)
    assert m.nodes == [head] and len(tree) == 2


def test_split_without_split_value_raises_and_leaves_tree_intact() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert([1, 2, 3], lambda s, e: "kv")
    with pytest.raises(ValueError):
        tree.insert([1, 2])
    with pytest.raises(ValueError):
        tree.match_prefix([1, 5], split=True)
    assert len(tree) == 1 and tree.sequences() == [(1, 2, 3)]
    # Nodes without values split fine without split_value.
    tree.insert([7, 8])
    assert tree.insert([7]).tokens == (7,)


def test_split_keeps_the_access_time() -> None:
    tree = new_tree()
    leaf = tree.insert([1, 2, 3], value_for((1, 2, 3)))
    before = leaf.last_access
    head = tree.insert([1, 2])
    # The split copies the access time; then the insert touches only the part it used.
    assert leaf.last_access == before < head.last_access
    assert tree.evict(1) == 1 and [1, 2] in tree and [1, 2, 3] not in tree


def test_evict_lru_order_and_parent_cascade() -> None:
    tree = new_tree()
    tree.insert([1, 1])
    tree.insert([1, 2])
    tree.insert([2])
    tree.match_prefix([1, 1])  # (1,1) is now the most recent; (1,)'s (2) child the oldest
    order: list[Seq] = []
    assert tree.evict(2, lambda n: order.append(path_tokens(n))) == 2
    assert order == [(1, 2), (2,)]
    assert tree.evict(100, lambda n: order.append(path_tokens(n))) == 2
    assert order == [(1, 2), (2,), (1, 1), (1,)]
    assert len(tree) == 0


def test_dfs_order_is_preorder_by_first_token() -> None:
    tree = new_tree()
    for s in [(2,), (0, 1, 5), (0, 1, 3), (1,), (0, 0)]:
        tree.insert(s)
    assert [n.tokens for n in tree.dfs()] == [(0,), (0,), (1,), (3,), (5,), (1,), (2,)]
    assert [n.start for n in tree.dfs()] == [0, 1, 1, 2, 2, 0, 0]
    assert tree.sequences() == [(0, 0), (0, 1, 3), (0, 1, 5), (1,), (2,)]


def test_deep_tree_needs_no_recursion() -> None:
    depth = sys.getrecursionlimit() + 200
    tree = new_tree()
    full = tuple(i % 4 for i in range(depth))
    tree.insert(full, value_for(full))
    for i in range(1, depth):
        tree.match_prefix(full[:i], split=True)
    assert len(tree) == depth
    nodes = list(tree.dfs())
    assert [n.start for n in nodes] == list(range(depth))
    assert tree.sequences() == [full]
    assert tree.evict(depth) == depth and len(tree) == 0


def test_a_dropped_tree_frees_its_values_without_the_cycle_collector() -> None:
    """Nodes hold their parents weakly: dropping a tree (the prefix cache does at every weight update)
    frees every node's value by reference counting, not at the next full garbage collection."""
    import gc
    import weakref

    class Piece:  # stands for a KV tensor
        def __init__(self, a: int, b: int) -> None:
            self.span = (a, b)

        def split(self, k: int) -> tuple[Piece, Piece]:
            return Piece(self.span[0], self.span[0] + k), Piece(self.span[0] + k, self.span[1])

    tree: RadixTree[Piece] = RadixTree(split_value=lambda v, k: v.split(k))
    for s in [(0, 1, 2, 3), (0, 1, 5), (0, 2), (4,)]:
        tree.insert(s, Piece)
    tree.match_prefix((0, 1, 2), split=True)
    alive = [weakref.ref(n.value) for n in tree.dfs()]
    assert len(alive) == 7 and all(r() is not None for r in alive)
    assert all(n.parent is not None for n in tree.dfs())
    gc.disable()
    try:
        del tree
        assert [r() for r in alive] == [None] * 7
    finally:
        gc.enable()
