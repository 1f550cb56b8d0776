"""The rank split: whole groups (prefix trees) per rank, balanced by the tokens their tree computes."""

from __future__ import annotations

import random

import pytest

from arborl.train.parallel import balanced_split, group_units, unit_tokens
from arborl.types import Sample
from helpers.parallel import make_samples


def _tree_load(samples, share):
    # a rank's tree tokens = the sum over its groups (groups do not share prefixes with each other here)
    mine = [samples[i] for i in share]
    return sum(unit_tokens(mine, u) for u in group_units(mine))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_groups_stay_whole_and_the_imbalance_is_below_one_group(seed, ranks):
    rng = random.Random(seed)
    samples = make_samples(seed, groups=rng.randint(ranks, 12), size=rng.randint(1, 6), prompt=(2, 40))
    shares = balanced_split(samples, ranks)
    assert sorted(i for s in shares for i in s) == list(range(len(samples)))
    where = {i: r for r, s in enumerate(shares) for i in s}
    for unit in group_units(samples):
        assert len({where[i] for i in unit}) == 1  # a group (its shared prompt) lives on one rank
    loads = [_tree_load(samples, s) for s in shares]
    biggest = max(unit_tokens(samples, u) for u in group_units(samples))
    assert max(loads) - min(loads) <= biggest
    assert balanced_split(samples, ranks) == shares  # every rank computes the same split


def _group(gid: str, prompt: int, responses: list[int], first: int) -> list[Sample]:
    out = []
    head = list(range(first, first + prompt))
    for k, n in enumerate(responses):
        toks = head + [1000 + k * 50 + j for j in range(n)]
        mask = [0] * prompt + [1] * n
        out.append(Sample(episode_id=f"{gid}{k}", group_id=gid, token_ids=toks, loss_mask=mask,
                          rollout_logprobs=[0.0] * len(toks), versions=[0] * len(toks), chunk_ids=[0] * len(toks),
                          advantages=[1.0 if m else 0.0 for m in mask], reward=1.0))
    return out


def test_the_balance_is_on_tree_tokens_not_flat_tokens():
    # A: 8 samples sharing a 60-token prompt (flat 8 x 65 = 520, tree 60 + 40 = 100); B, C, D: one sample of
    # 60 tokens each (flat = tree = 60). On tree tokens: A | B C -> then D joins A: 160 vs 120; on flat tokens
    # A looks huge and B, C, D all land on the other rank: 100 vs 180
    samples = (_group("A", 60, [5] * 8, 0) + _group("B", 10, [50], 100) + _group("C", 10, [50], 200)
               + _group("D", 10, [50], 300))
    by_tree = sorted(_tree_load(samples, s) for s in balanced_split(samples, 2, tree=True))
    by_flat = sorted(_tree_load(samples, s) for s in balanced_split(samples, 2, tree=False))
    assert by_tree == [120, 160] and by_flat == [100, 180]


def test_more_ranks_than_groups_leaves_ranks_empty():
    samples = make_samples(0, groups=2, size=3)
    shares = balanced_split(samples, 4)
    assert sum(1 for s in shares if s) == 2
    with pytest.raises(ValueError):
        balanced_split(samples, 0)
