"""A draft: the tokens a drafter proposes for one sequence, as a token tree.

Node ``i`` holds ``tokens[i]`` and hangs under ``parents[i]`` (-1: under the sequence's last token,
the root, which the verify forward runs as node 0). Parents come before their children, so a single
path is ``parents = [-1, 0, 1, ...]`` and several candidate paths share their common prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int]) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> "Draft":
        """Merge candidate paths into one tree (shared prefixes once), first path first."""
        d = cls()
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for path in paths:
            parent = -1
            for tok in path:
                node = index.get((parent, tok))
                if node is None:
                    node = len(d.tokens)
                    d.tokens.append(tok)
                    d.parents.append(parent)
                    index[(parent, tok)] = node
                parent = node
        return d

    def __len__(self) -> int:
        return len(self.tokens)

    def depth(self) -> int:
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    def truncated(self, max_depth: int) -> "Draft":
        """The nodes at depth <= max_depth (parents stay before children, so indices only shrink)."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return self._kept([d <= max_depth for d in depths])

    def ending_at(self, stop: set[int] | frozenset[int]) -> "Draft":
        """Without the nodes under a ``stop`` token: a sequence ends there, so nothing drafted after it
        could ever be emitted (the stop token itself stays: accepting it ends the sequence)."""
        if not any(t in stop for t in self.tokens):
            return self  # the common case: nothing to cut, no copy
        kept: list[bool] = []
        for p in self.parents:
            kept.append(p < 0 or (kept[p] and self.tokens[p] not in stop))
        return self._kept(kept)

    def _kept(self, kept: list[bool]) -> "Draft":
        # parents come before children and a dropped node's children are dropped: indices only shrink
        remap: dict[int, int] = {}
        for i, k in enumerate(kept):
            if k:
                remap[i] = len(remap)
        return Draft([self.tokens[i] for i in remap], [-1 if self.parents[i] < 0 else remap[self.parents[i]] for i in remap])
