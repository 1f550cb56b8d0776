"""What drafting could reach on given texts, without timing noise (``arborl bench specdec``'s ceilings).

Sampling is keyed by (seed, position) (``engine/sampling.py``), so a sequence's text does not depend
on whether or what it drafted: a single-path draft's accepted count is its common prefix with the text
that follows. Over the texts the plain engine sampled, every decode position's draft and its accepted
count are tabulated once; decoding a wave of ``batch`` sequences is then replayed step by step, with
the verify profile's cost T(B, n) per step, under a rule for how much of each draft to verify:

- ``suffix``: the group suffix draft as the drafter proposes it (k deep, ``min_prob`` cut);
- ``suffix_oracle``: only the part of that draft that will be accepted (no selection rule over the
  suffix drafts can do better);
- ``greedy_oracle``: a free drafter proposing the policy's own most likely next tokens, as many as the
  text then follows (what a perfect, cost-free MTP head or draft model would propose).

The ratio is replayed tokens/s against plain decoding of the same waves. A replayed step at
position i emits accepted + 1 tokens (the accepted drafts and the token drawn after them), at most
what is left of the text. The store a position drafts from holds the group's references and the
sequence's own tokens; the tokens its wave siblings decode meanwhile are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from arborl.config import SpecConfig
from arborl.engine.specdec.adaptive import VerifyProfile
from arborl.engine.specdec.suffix import TokenStore, suffix_draft
from arborl.prefix import common_prefix_len
from arborl.types import GenerateResult


@dataclass(frozen=True)
class Position:
    """One decode step's choice point: output tokens before it are known."""

    drafted: int  # tokens of the suffix draft here (single path, cut after a stop token)
    accepted: int  # how many of them the text continues with
    greedy_run: int  # how many next tokens in a row are the policy's most likely one (up to k)


Rule = Callable[[Position], tuple[int, int]]  # position -> (draft tokens verified, tokens accepted of them)

RULES: dict[str, Rule] = {
    "suffix": lambda p: (p.drafted, p.accepted),
    "suffix_oracle": lambda p: (p.accepted, p.accepted),
    "greedy_oracle": lambda p: (p.greedy_run, p.greedy_run),
}


@torch.inference_mode()
def position_table(model: torch.nn.Module, result: GenerateResult, store: TokenStore, config: SpecConfig, k: int,
                   stop: frozenset[int]) -> list[Position]:
    """The positions of ``result``'s decode steps (output index 1 on: the first token comes from the
    prefill), drafting from ``store`` (a copy the sequence's own tokens are fed into as it goes)."""
    prompt, out = list(result.prompt_token_ids), list(result.token_ids)
    stream = prompt + out
    store.extend("replayed", stream[: len(prompt) + 1], len(prompt))
    logits = model(torch.tensor([stream])).logits[0]
    greedy = logits.argmax(-1).tolist()  # greedy[j]: the most likely token after stream[: j + 1]
    table = []
    for n in range(len(prompt) + 1, len(stream)):
        truth = stream[n : n + k]
        path = suffix_draft(store, stream[:n], k, config, num_paths=1).ending_at(stop).tokens
        accepted = common_prefix_len(path, truth)
        run = common_prefix_len(greedy[n - 1 : n - 1 + k], truth)
        table.append(Position(len(path), accepted, run))
        store.extend("replayed", stream[n : n + 1])
    return table


def replay(tables: list[list[Position]], profile: VerifyProfile, batch: int, rule: Rule) -> dict:
    """Tokens/s of speculative vs plain decoding of ``tables`` in waves of ``batch`` (in order), each
    step costing the profile's T(active sequences, mean verified draft tokens)."""
    spec_tok = spec_s = plain_tok = plain_s = 0.0
    steps = 0
    per_draft: list[int] = []  # accepted tokens of each verified draft, in decoding order
    for w in range(0, len(tables), batch):
        wave = tables[w : w + batch]
        plain_pos, pos = [0] * len(wave), [0] * len(wave)
        while active := [i for i, t in enumerate(wave) if plain_pos[i] < len(t)]:
            plain_s += profile.cost(len(active), 0)
            plain_tok += len(active)
            for i in active:
                plain_pos[i] += 1
        while active := [i for i, t in enumerate(wave) if pos[i] < len(t)]:
            chosen = [rule(wave[i][pos[i]]) for i in active]
            # a draft is cut where the text ends (the engine's max_tokens / stop-token cuts)
            verified = [min(v, len(wave[i]) - pos[i] - 1) for i, (v, _) in zip(active, chosen)]
            spec_s += profile.cost(len(active), sum(verified) / len(active))
            steps += 1
            for i, v, (_, a) in zip(active, verified, chosen):
                if v > 0:
                    per_draft.append(min(a, v))
                gained = min(1 + min(a, v), len(wave[i]) - pos[i])
                pos[i] += gained
                spec_tok += gained
    return {"ratio": (spec_tok / spec_s) / (plain_tok / plain_s), "steps": steps, "tokens": int(spec_tok),
            "drafts": len(per_draft), "accepted": sum(per_draft), "accepted_per_draft": per_draft}


def free_rows(profile: VerifyProfile) -> VerifyProfile:
    """The profile of a machine where verify rows cost nothing over a decode step (a GPU at small batch
    is close to it): T(B, n) = T(B, 0)."""
    decode = [[row[0]] * len(row) for row in profile.seconds]
    return VerifyProfile(list(profile.batches), list(profile.positions), decode)
