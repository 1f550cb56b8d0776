"""Adaptive draft length (Seer's marginal-benefit rule).

A step that verifies k draft positions for a batch of B sequences costs T(B, k) seconds (the verify
profile, measured at engine start or loaded) plus the drafting time, and yields 1 + sum_{j<=k} a_j
tokens for each of the f * B sequences that got a draft (1 for the others), a_j being the live
acceptance of draft position j per draft. Each step takes the k (0 = plain decoding) with the most
tokens per second; where the verify cost outgrows what acceptance brings (large batches) that is
k = 0 and speculation is off. While it is off the measured acceptance relaxes towards the prior, so
speculation is tried again later (drafts may have become better: the group's siblings progressed).

The per-sequence work around a verify forward (drafting, and the acceptance walk over each sequence's
logits) is measured live and added to the cost; it grows with the batch while the profile's forward
does not see it. A k > 0 must beat plain decoding by ``MIN_GAIN``: near break-even (large batches)
the profile's timing noise and the acceptance estimate's error are larger than the gain, and there a
wrong guess loses throughput while a right one gains almost nothing.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

DECAY = 0.995  # per recorded draft: acceptance follows the policy as it trains
RELAX = 0.98  # per plain step: what was measured fades towards the prior while speculation is off
PRIOR_WEIGHT = 8.0  # drafts' worth of the prior acceptance
MIN_GAIN = 1.05  # expected tokens/s over plain decoding that a k > 0 must reach


@dataclass
class VerifyProfile:
    """T(B, n): seconds of one verify forward of B sequences with n draft positions (n = 0: decode)."""

    batches: list[int]
    positions: list[int]
    seconds: list[list[float]]  # [batch index][position index]

    def cost(self, batch: int, n: float) -> float:
        per_b = [_interp(self.positions, self.seconds[i], n) for i in range(len(self.batches))]
        return _interp(self.batches, per_b, batch)

    def to_json(self) -> dict:
        return {"batches": self.batches, "positions": self.positions, "seconds": self.seconds}

    @classmethod
    def load(cls, path: str | Path) -> "VerifyProfile":
        d = json.loads(Path(path).read_text())
        return cls(list(d["batches"]), list(d["positions"]), monotone([list(r) for r in d["seconds"]]))

    @classmethod
    def measure(cls, run: Callable[[int, int], None], batches: list[int], positions: list[int], rounds: int = 5) -> "VerifyProfile":
        """Time ``run(B, n)`` on the grid: one warm-up pass, then ``rounds`` passes over the whole grid,
        the fastest per cell, made monotone. Passes over the grid, not repeats of one cell: a busy
        spell of the machine then slows a cell in one pass, not in all its timings. (Best of 3
        consecutive timings per cell gave T(2, 0) = 75 ms above T(4, 0) = 64 ms, and the rule turned
        speculation off at batch 4 and on at batch 3 of the same text.)"""
        cells = [(i, j) for i in range(len(batches)) for j in range(len(positions))]
        for i, j in cells:
            run(batches[i], positions[j])
        seconds = [[float("inf")] * len(positions) for _ in batches]
        for _ in range(rounds):
            for i, j in cells:
                t0 = time.perf_counter()
                run(batches[i], positions[j])
                seconds[i][j] = min(seconds[i][j], time.perf_counter() - t0)
        return cls(list(batches), list(positions), monotone(seconds))


def monotone(seconds: list[list[float]]) -> list[list[float]]:
    """The table made non-decreasing along both axes (more sequences or more positions never cost
    less) by pooling adjacent violators, row- and column-wise until both hold: a cell that timing
    noise put above its larger neighbour is averaged with it, not copied up or down the table."""
    t = [list(r) for r in seconds]
    for _ in range(100):  # alternating passes converge; a handful is typical
        if _sorted(t) and _sorted([list(c) for c in zip(*t)]):
            break
        t = [_pav(r) for r in t]
        t = [list(r) for r in zip(*[_pav(list(c)) for c in zip(*t)])]
    return t


def _sorted(rows: list[list[float]]) -> bool:
    return all(a <= b + 1e-12 for r in rows for a, b in zip(r, r[1:]))


def _pav(ys: list[float]) -> list[float]:
    """Isotonic (non-decreasing) least-squares fit of ``ys`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def _ema(old: float, new: float) -> float:
    return 0.9 * old + 0.1 * new if old else new


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended linearly past the ends."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass
class AdaptiveLength:
    max_k: int
    prior: float
    profile: VerifyProfile | None
    paths: int = 1  # candidate paths per draft: verify positions ~ k * paths
    adaptive: bool = True
    draft_s_per_seq: float = 0.0  # running estimate of drafting time per sequence
    accept_s_per_seq: float = 0.0  # running estimate of the acceptance walk's time per sequence
    _acc: list[float] = field(default_factory=list)  # decayed accepted count per position
    _seen: list[float] = field(default_factory=list)  # decayed number of drafts that observed each position

    def __post_init__(self) -> None:
        self._acc = [0.0] * self.max_k
        self._seen = [0.0] * self.max_k

    def acceptance(self) -> list[float]:
        """a_j, the expected accepted tokens at draft position j per draft (prior where unmeasured)."""
        out = []
        for j in range(self.max_k):
            prior = self.prior ** (j + 1)
            out.append((self._acc[j] + PRIOR_WEIGHT * prior) / (self._seen[j] + PRIOR_WEIGHT))
        return out

    def record(self, accepted: int, verified: int | None = None, depth: int | None = None, asked: int | None = None) -> None:
        """One draft: ``accepted`` of its tokens were accepted. It observed positions < ``verified`` (the k
        it was verified at) and, where the drafter had fewer than the ``asked`` tokens (``depth``), every
        position from ``depth`` on (nothing there to accept at any k). The positions between ``verified``
        and what the drafter had are censored, not rejected: counting them as zeros would make a small k
        its own evidence and the rule could never lengthen the drafts again. (None: every position.)"""
        verified = self.max_k if verified is None else verified
        short = depth is not None and asked is not None and depth < asked
        for j in range(self.max_k):
            if j < verified or (short and j >= depth):
                self._seen[j] = self._seen[j] * DECAY + 1
                self._acc[j] = self._acc[j] * DECAY + (1.0 if j < accepted else 0.0)

    def record_draft_time(self, seconds: float, seqs: int) -> None:
        if seqs:
            self.draft_s_per_seq = _ema(self.draft_s_per_seq, seconds / seqs)

    def record_accept_time(self, seconds: float, seqs: int) -> None:
        if seqs:
            self.accept_s_per_seq = _ema(self.accept_s_per_seq, seconds / seqs)

    def tokens_per_s(self, batch: int, k: int, drafted: float = 1.0, sizes: list[int] | None = None) -> float:
        """Expected tokens per second with k draft positions when a share ``drafted`` of the batch has a draft.
        ``sizes``: the node counts of this step's drafts, for a verify that packs trees without padding
        (the engine's kernel path): its cost is that of the mean positions per sequence, not k's."""
        assert self.profile is not None
        gain = 1.0 + drafted * sum(self.acceptance()[:k])
        positions = k * self.paths
        if sizes and k:
            positions = sum(min(n, positions) for n in sizes) / len(sizes)
        cost = self.profile.cost(batch, positions)
        if k:
            cost += batch * (self.draft_s_per_seq + self.accept_s_per_seq)
        return batch * gain / cost

    def choose(self, batch: int, drafted: float = 1.0, sizes: list[int] | None = None) -> int:
        if not self.adaptive or self.profile is None or self.max_k == 0:
            return self.max_k
        rate = lambda k: self.tokens_per_s(batch, k, drafted, sizes)  # noqa: E731
        k = max(range(1, self.max_k + 1), key=lambda k: (rate(k), -k))
        return k if rate(k) >= MIN_GAIN * self.tokens_per_s(batch, 0) else 0

    def relax(self) -> None:
        self._seen = [n * RELAX for n in self._seen]
        self._acc = [a * RELAX for a in self._acc]
