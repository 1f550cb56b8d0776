"""The cost model of one engine instance, and its fit to measurements of the built-in engine.

    decode step (s)  = decode_base_s + decode_per_seq_s * batch + decode_per_ctx_token_s * sum(context)
    prefill (s)      = prefill_base_s + prefill_per_token_s * tokens + prefill_per_token2_s * tokens^2
    KV migration (s) = transfer_per_token_s * tokens          (scheduling.migration = transfer)

Speculative decoding (``spec_acceptance`` a > 0): a verify step with k draft tokens per sequence runs
B * (1 + k) tokens, ``decode_base_s + decode_per_seq_s * B * (1 + k)`` plus the KV reads, and yields
E(k) = 1 + a + ... + a^k tokens per sequence; the engine's adaptive rule takes the k (0 = plain
decoding) with the least time per token, so a token of a batch of B costs ``spec_factor(B)`` times a
plain step: well below 1 at the small batches of the tail, 1 where the batch is compute-bound.

``fit_decode`` / ``fit_prefill`` are least-squares fits of those lines to (batch, context, seconds)
and (tokens, seconds) measurements; ``arborl.sim.calibrate`` takes the measurements on the built-in
engine. The defaults describe a GPU serving instance (a ~30B dense model on 8 accelerators: a flat
step time dominated by reading the weights, KV reads proportional to the context), not this CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    decode_base_s: float = 0.020
    decode_per_seq_s: float = 5e-5
    decode_per_ctx_token_s: float = 1.0e-8
    prefill_base_s: float = 0.005
    prefill_per_token_s: float = 2.0e-5
    prefill_per_token2_s: float = 0.0  # attention's quadratic part: it dominates long prompts of small models
    transfer_per_token_s: float = 2.0e-6
    kv_capacity_tokens: int = 1_000_000
    max_batch: int = 256
    weight_update_s: float = 20.0
    spec_acceptance: float = 0.0
    spec_max_k: int = 4

    def spec_factor(self, batch: int) -> float:
        """Time per generated token relative to plain decoding, at the best draft length (<= 1)."""
        a = self.spec_acceptance
        if a <= 0 or batch <= 0:
            return 1.0
        plain = self.decode_base_s + self.decode_per_seq_s * batch
        best = 1.0
        for k in range(1, self.spec_max_k + 1):
            gain = sum(a**j for j in range(k + 1))
            best = min(best, (self.decode_base_s + self.decode_per_seq_s * batch * (1 + k)) / (plain * gain))
        return best

    def step_s(self, batch: int, context: int) -> float:
        """Seconds per generated token of every sequence of the batch (a decode step, or a verify step
        divided by the tokens it yields)."""
        plain = self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * context
        return plain * self.spec_factor(batch)

    def steps_s(self, batch: int, context: int, steps: int) -> float:
        """Seconds of ``steps`` decode steps of a fixed batch whose total context starts at ``context``
        and grows by ``batch`` tokens a step."""
        if steps <= 0:
            return 0.0
        growth = self.decode_per_ctx_token_s * batch * steps * (steps - 1) / 2 * self.spec_factor(batch)
        return steps * self.step_s(batch, context) + growth

    def steps_within(self, batch: int, context: int, seconds: float) -> int:
        """Fewest steps whose duration reaches ``seconds`` (ceil of the quadratic's root)."""
        if seconds <= 0:
            return 0
        qa = self.decode_per_ctx_token_s * batch / 2 * self.spec_factor(batch)
        qb = self.step_s(batch, context) - qa
        if qa <= 1e-18:
            s = seconds / qb
        else:
            s = (-qb + (qb * qb + 4 * qa * seconds) ** 0.5) / (2 * qa)
        n = max(1, int(np.ceil(s - 1e-9)))
        while n > 1 and self.steps_s(batch, context, n - 1) >= seconds:
            n -= 1
        while self.steps_s(batch, context, n) < seconds:
            n += 1
        return n

    def prefill_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.prefill_base_s + self.prefill_per_token_s * tokens + self.prefill_per_token2_s * tokens * tokens

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Fit:
    params: dict[str, float]
    r2: float
    max_rel_err: float
    points: list[tuple]  # inputs..., measured, predicted

    def as_dict(self) -> dict:
        return {"params": self.params, "r2": self.r2, "max_rel_err": self.max_rel_err,
                "points": [list(p) for p in self.points]}


def _lstsq(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, float, np.ndarray]:
    # relative-error weighting: every point counts the same whatever its scale
    w = 1.0 / np.maximum(y, 1e-12)
    # a cost is never negative: a term whose fitted coefficient is negative is dropped and the rest refit
    keep = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[keep], *_ = np.linalg.lstsq(X[:, keep] * w[:, None], y * w, rcond=None)
        if len(keep) == 1 or coef[keep].min() >= 0:
            break
        keep.remove(keep[int(np.argmin(coef[keep]))])
    coef = np.maximum(coef, 0.0)
    pred = X @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-30
    return coef, 1 - ss_res / ss_tot, float(np.max(np.abs(pred - y) / y)), pred


def fit_decode(points: list[tuple[int, int, float]]) -> Fit:
    """points: (batch, total context tokens, seconds per decode step)."""
    B = np.array([p[0] for p in points], float)
    C = np.array([p[1] for p in points], float)
    y = np.array([p[2] for p in points], float)
    coef, r2, err, pred = _lstsq(np.stack([np.ones_like(B), B, C], 1), y)
    params = {"decode_base_s": float(coef[0]), "decode_per_seq_s": float(coef[1]), "decode_per_ctx_token_s": float(coef[2])}
    return Fit(params, r2, err, [(int(b), int(c), float(m), float(p)) for b, c, m, p in zip(B, C, y, pred)])


def fit_prefill(points: list[tuple[int, float]]) -> Fit:
    """points: (prompt tokens, seconds of their prefill)."""
    n = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    coef, r2, err, pred = _lstsq(np.stack([np.ones_like(n), n, n * n], 1), y)
    params = {"prefill_base_s": float(coef[0]), "prefill_per_token_s": float(coef[1]), "prefill_per_token2_s": float(coef[2])}
    return Fit(params, r2, err, [(int(a), float(m), float(p)) for a, m, p in zip(n, y, pred)])
