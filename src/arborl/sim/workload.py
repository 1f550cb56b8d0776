"""Simulated workloads: GRPO groups of agent episodes with long-tailed lengths.

A group shares one prompt; its members' lengths are correlated: each prompt draws a log-median
``mu_p = log(median) + sigma_prompt * z`` and each member turn draws ``exp(mu_p + sigma_member * z')``,
clipped to [min_tokens, max_tokens]. Episodes have 1..turns turns (uniform per member when turns > 1);
after each turn the environment takes a lognormal latency (median ``env_median_s``, log-sd
``env_sigma``) and answers with ``obs_tokens`` tokens. A group's rewards differ (it carries a learning
signal) with probability ``mixed_fraction``, drawn on its own stream so the lengths do not move with it.
The i-th group is a pure function of (seed, i), so every policy compared on one workload sees the same
groups in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TurnPlan:
    tokens: int  # tokens the model generates in this turn (its natural length)
    env_s: float  # environment latency after it (seconds)


@dataclass(frozen=True, slots=True)
class EpisodePlan:
    member: int
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True)
class Workload:
    group_size: int = 8
    prompt_tokens: int = 1024
    length_median: float = 8192.0
    sigma_prompt: float = 1.0
    sigma_member: float = 0.35
    max_tokens: int = 65536
    min_tokens: int = 16
    turns: int = 1
    obs_tokens: int = 0
    env_median_s: float = 0.0
    env_sigma: float = 1.0
    mixed_fraction: float = 1.0
    seed: int = 0

    def mixed(self, index: int) -> bool:
        """Whether group ``index``'s rewards differ (False: all-equal, no learning signal)."""
        if self.mixed_fraction >= 1.0:
            return True
        return bool(np.random.default_rng([self.seed, index, 1]).random() < self.mixed_fraction)

    def rewards(self, index: int) -> list[float]:
        """Group ``index``'s outcome rewards as a consumption policy sees them: one pass among fails when
        mixed, all fails otherwise."""
        first = 1.0 if self.mixed(index) else 0.0
        return [first] + [0.0] * (self.group_size - 1)

    def group(self, index: int) -> list[EpisodePlan]:
        rng = np.random.default_rng([self.seed, index])
        mu = math.log(self.length_median) + self.sigma_prompt * rng.standard_normal()
        out = []
        for m in range(self.group_size):
            n = int(rng.integers(1, self.turns + 1)) if self.turns > 1 else 1
            turns = []
            for _ in range(n):
                L = int(round(math.exp(mu + self.sigma_member * rng.standard_normal())))
                env = 0.0
                if self.env_median_s > 0:
                    env = float(self.env_median_s * math.exp(self.env_sigma * rng.standard_normal()))
                turns.append(TurnPlan(min(self.max_tokens, max(self.min_tokens, L)), env))
            out.append(EpisodePlan(m, tuple(turns)))
        return out

    def mean_tokens(self, groups: int = 200) -> float:
        toks = [t.tokens for i in range(groups) for ep in self.group(i) for t in ep.turns]
        return float(np.mean(toks))
