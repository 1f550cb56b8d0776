"""Speculative-decoding counters, with vLLM's definitions: a draft is one sequence's proposal in one
step (counted when the drafter was asked, even if it proposed nothing); acceptance rate = accepted /
draft tokens; mean acceptance length = 1 + accepted / drafts (tokens per verify forward and sequence);
per-position acceptance = how often draft position j was accepted, per draft."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    drafts: int = 0
    draft_tokens: int = 0  # nodes of every draft tree
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    verify_steps: int = 0  # decode steps run as a verify forward
    plain_steps: int = 0  # decode steps where drafting did not pay (adaptive k = 0) or nothing was proposed
    draft_s: float = 0.0  # seconds spent drafting

    def record(self, num_nodes: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_nodes
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < accepted:
            self.accepted_per_pos.append(0)
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_drafts": self.drafts,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_acceptance_length": self.mean_acceptance_length,
            "spec_acceptance_per_position": [a / self.drafts for a in self.accepted_per_pos] if self.drafts else [],
            "spec_verify_steps": self.verify_steps,
            "spec_plain_steps": self.plain_steps,
            "spec_draft_s": self.draft_s,
        }


def combine(rows: list[dict]) -> dict:
    """Several engines' ``as_dict`` rows as one flat row of numbers (counters summed, rates recomputed,
    per-position acceptance as ``spec_acceptance_pos<j>``); {} when none."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    m = SpecMetrics()
    for r in rows:
        m.drafts += r["spec_drafts"]
        m.draft_tokens += r["spec_draft_tokens"]
        m.accepted_tokens += r["spec_accepted_tokens"]
        m.verify_steps += r["spec_verify_steps"]
        m.plain_steps += r["spec_plain_steps"]
        m.draft_s += r["spec_draft_s"]
        per_pos = [round(a * r["spec_drafts"]) for a in r["spec_acceptance_per_position"]]
        m.accepted_per_pos += [0] * (len(per_pos) - len(m.accepted_per_pos))
        for j, a in enumerate(per_pos):
            m.accepted_per_pos[j] += a
    d = m.as_dict()
    for j, a in enumerate(d.pop("spec_acceptance_per_position")):
        d[f"spec_acceptance_pos{j + 1}"] = a
    return d
