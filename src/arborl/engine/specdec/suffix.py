"""Suffix drafts (SuffixDecoding; I4) from the request's own tokens and its GRPO group's (Seer).

A ``TokenStore`` keeps token streams (one per request: prompt + output) with an index of where every
n-gram (n = ``min_match``) ends. To draft, the last n tokens of the context find their earlier
occurrences; each occurrence's match is extended backwards (up to ``max_match`` tokens) and the
occurrences with the longest match vote for what follows. The single path follows the most frequent
next token while the path's empirical probability stays >= ``min_prob``; multi-path adds the most
frequent other continuations (Seer's top-k paths), verified together as one tree. Where the last n
tokens never occurred, ``fallback_tokens`` draft tokens may follow the last token alone (a 1-token
match, single path, only for a clear favourite of the votes): rambling text at temperature 1 has no
n-gram match on half its steps, and with the verify packing trees without padding one extra row is
cheap.

One store per GRPO group, shared by the engines of a process, is fed by every member as it decodes,
so a member drafts from its siblings; a request without a group (or with ``group_trees`` off) drafts
from a store of its own. (The radix tree in ``prefix/`` indexes prefixes, not suffixes, so it does
not fit here.)
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from arborl.config import SpecConfig
from arborl.engine.sequence import Sequence
from arborl.engine.specdec.draft import Draft
from arborl.engine.specdec.drafter import DRAFTERS, EngineView

MAX_OCCURRENCES = 64  # most recent occurrences of an n-gram looked at per draft
# a draft from a 1-token match (``fallback_tokens``) needs this share of the votes: such matches are
# weak evidence, and the verify rows they cost are only worth it for a clear favourite
FALLBACK_MIN_PROB = 0.3


class TokenStore:
    """Token streams and an n-gram -> (stream, end) index; writers from several threads are safe."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.streams: dict[str, list[int]] = {}
        self.index: dict[tuple[int, ...], list[tuple[list[int], int]]] = {}
        # where every single token ends (the fallback when the context's last n tokens never occurred)
        self.unigrams: dict[int, list[tuple[list[int], int]]] = {}
        self.prompt_lens: dict[str, int] = {}
        self.lock = threading.Lock()

    def copy(self) -> "TokenStore":
        """A store with the same streams (and prompts), indexed anew."""
        out = TokenStore(self.n)
        with self.lock:
            streams = [(key, list(s), self.prompt_lens.get(key, 0)) for key, s in self.streams.items()]
        for key, s, plen in streams:
            out.extend(key, s, plen)
        return out

    def extend(self, key: str, tokens: list[int], prompt_len: int = 0) -> None:
        """Append ``tokens`` to stream ``key``; a new stream's first ``prompt_len`` tokens are its prompt.
        The part of a prompt that repeats the start of a stream already held (the prompt a GRPO group's
        members share, a multi-turn episode's earlier turns) is kept for matching but not indexed again:
        there it would only repeat that stream's continuations, one vote per member, and outvote or
        crowd out the members' own answers. Outputs are always indexed: members that sampled the same
        words are that many votes for them."""
        n = self.n
        with self.lock:
            s = self.streams.get(key)
            known = 0
            if s is None:
                if prompt_len:
                    head = tokens[:prompt_len]
                    known = max((common_prefix(o, head) for o in self.streams.values()), default=0)
                self.prompt_lens[key] = prompt_len
                s = self.streams[key] = []
            for t in tokens:
                s.append(t)
                if len(s) < known:  # the same token follows here in the stream that holds this start
                    continue
                if len(s) >= n:
                    self.index.setdefault(tuple(s[-n:]), []).append((s, len(s)))
                if n > 1:
                    self.unigrams.setdefault(t, []).append((s, len(s)))

    def followers(self, token: int, k: int) -> list[list[int]]:
        """The next (up to) ``k`` tokens after every recent occurrence of ``token`` (a 1-token match)."""
        if self.n == 1:
            return self.continuations([token], k, 1)
        with self.lock:
            occ = list(self.unigrams.get(token, ())[-MAX_OCCURRENCES:])
        return [s[end : end + k] for s, end in reversed(occ) if end < len(s)]

    def num_tokens(self) -> int:
        return sum(len(s) for s in self.streams.values())

    def continuations(self, context: list[int], k: int, max_match: int) -> list[list[int]]:
        """The next (up to) ``k`` tokens after every recent occurrence of the context's longest
        matching suffix (at least n tokens long), most recent first."""
        n = self.n
        if len(context) < n or k <= 0:
            return []
        with self.lock:
            occ = list(self.index.get(tuple(context[-n:]), ())[-MAX_OCCURRENCES:])
        best, conts = 0, []
        for s, end in reversed(occ):
            if end >= len(s):
                continue  # nothing follows yet (e.g. the context's own last tokens)
            m = n
            while m < max_match and m < len(context) and end - 1 - m >= 0 and s[end - 1 - m] == context[-1 - m]:
                m += 1
            if m > best:
                best, conts = m, []
            if m == best:
                conts.append(s[end : end + k])
        return conts


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search on slice equality: the
    comparisons run in C, a prompt of thousands of tokens costs microseconds)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class GroupStores:
    """One ``TokenStore`` per GRPO group, least recently used dropped past ``max_groups``."""

    def __init__(self, max_groups: int) -> None:
        self.max_groups = max_groups
        self._stores: OrderedDict[str, TokenStore] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, group_id: str, n: int) -> TokenStore:
        with self._lock:
            store = self._stores.get(group_id)
            if store is None or store.n != n:
                store = self._stores[group_id] = TokenStore(n)
            self._stores.move_to_end(group_id)
            while len(self._stores) > self.max_groups:
                self._stores.popitem(last=False)
            return store

    def copy(self) -> "GroupStores":
        """Copies of every group's store (each indexed anew), in the same order."""
        out = GroupStores(self.max_groups)
        with self._lock:
            items = list(self._stores.items())
        for gid, store in items:
            out._stores[gid] = store.copy()
        return out

    def __len__(self) -> int:
        return len(self._stores)


_SHARED: GroupStores | None = None
_SHARED_LOCK = threading.Lock()


def shared_group_stores(max_groups: int) -> GroupStores:
    """The process's group stores: engines of one process (an engine pool) share their groups' tokens."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = GroupStores(max_groups)
        _SHARED.max_groups = max(_SHARED.max_groups, max_groups)
        return _SHARED


def draft_paths(conts: list[list[int]], k: int, num_paths: int, min_prob: float) -> list[list[int]]:
    """Candidate paths from the continuations that vote: first the path of the most frequent next
    token at every depth (while its probability among the votes stays >= min_prob), then the most
    frequent other continuations."""
    if not conts:
        return []
    path: list[int] = []
    alive, prob = conts, 1.0
    while len(path) < k:
        counts = Counter(c[len(path)] for c in alive if len(c) > len(path))
        if not counts:
            break
        tok, c = counts.most_common(1)[0]
        prob *= c / len(alive)
        if prob < min_prob:
            break
        path.append(tok)
        alive = [a for a in alive if len(a) > len(path) - 1 and a[len(path) - 1] == tok]
    paths = [path] if path else []
    if num_paths > 1:
        for cont, _ in Counter(tuple(c) for c in conts if c).most_common():
            if len(paths) >= num_paths:
                break
            cand = list(cont)
            if not any(p[: len(cand)] == cand for p in paths):
                paths.append(cand)
    return paths


def suffix_paths(store: TokenStore, context: list[int], k: int, config: SpecConfig, num_paths: int | None = None) -> list[list[int]]:
    """The candidate paths (up to ``k`` tokens deep) that ``store`` proposes after ``context``: from the
    longest suffix match, else (``fallback_tokens``) a short single path from the context's last token."""
    paths = config.num_paths if num_paths is None else num_paths
    conts = store.continuations(context, k, config.max_match)
    if conts:
        return draft_paths(conts, k, paths, config.min_prob)
    if config.fallback_tokens and context:
        fb = min(k, config.fallback_tokens)
        return draft_paths(store.followers(context[-1], fb), fb, 1, max(config.min_prob, FALLBACK_MIN_PROB))
    return []


def suffix_draft(store: TokenStore, context: list[int], k: int, config: SpecConfig, num_paths: int | None = None) -> Draft:
    """``suffix_paths`` as one draft tree."""
    return Draft.from_paths(suffix_paths(store, context, k, config, num_paths))


def lookup_path(store: TokenStore, context: list[int], k: int, max_match: int) -> list[int]:
    """Prompt lookup: the (up to) ``k`` tokens that followed the most recent occurrence of the context's
    longest matching suffix in ``store`` (the request's own tokens), no vote: an agent that rewrites a span
    re-types what it read last, where the group's vote may favour another member's words."""
    conts = store.continuations(context, k, max_match)
    return conts[0] if conts else []


class SuffixDrafter:
    def __init__(self, config: SpecConfig, groups: GroupStores | None = None) -> None:
        self.config = config
        self.groups = groups if groups is not None else shared_group_stores(config.max_groups)
        self._fed: dict[str, int] = {}  # request id -> tokens of it already in its store(s)
        self._own: dict[str, TokenStore] = {}  # each request's own tokens (drafting without a group; prompt lookup)

    def _own_store(self, seq: Sequence) -> TokenStore:
        store = self._own.get(seq.request_id)
        if store is None:
            store = self._own[seq.request_id] = TokenStore(self.config.min_match)
        return store

    def _grouped(self, seq: Sequence) -> bool:
        return bool(self.config.group_trees and seq.request.group_id)

    def store_of(self, seq: Sequence) -> TokenStore:
        if self._grouped(seq):
            return self.groups.get(seq.request.group_id, self.config.min_match)
        return self._own_store(seq)

    def sync(self, seq: Sequence) -> None:
        rid = seq.request_id
        fed = self._fed.get(rid, 0)
        toks = seq.tokens
        if fed < len(toks):
            plen = len(seq.request.prompt_token_ids)
            self.store_of(seq).extend(rid, toks[fed:], plen)
            if self.config.prompt_lookup and self._grouped(seq):  # the own tokens beside the group's
                self._own_store(seq).extend(rid, toks[fed:], plen)
            self._fed[rid] = len(toks)

    def propose(self, seqs: list[Sequence], k: int) -> list[Draft]:
        return [self._draft(seq, k) for seq in seqs]

    def _draft(self, seq: Sequence, k: int) -> Draft:
        paths = suffix_paths(self.store_of(seq), seq.tokens, k, self.config)
        if self.config.prompt_lookup:
            own = lookup_path(self._own_store(seq), seq.tokens, k, self.config.max_match)
            if own and not any(p[: len(own)] == own for p in paths):
                paths.append(own)  # one more path of the verify tree (its shared prefix counted once)
        return Draft.from_paths(paths)

    def release(self, seq: Sequence) -> None:
        self.sync(seq)
        self._fed.pop(seq.request_id, None)
        self._own.pop(seq.request_id, None)

    def weights_updated(self) -> None:
        pass  # tokens stay good draft sources under new weights


@DRAFTERS.register("suffix")
def make_suffix_drafter(engine: EngineView) -> SuffixDrafter:
    return SuffixDrafter(engine.config.spec)
