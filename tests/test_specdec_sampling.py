"""Sampled speculative decoding follows the policy's distribution exactly (rejection sampling): a
chi-square test of sampled tokens against the exact distribution of a tiny model, and against the
engine without speculation. ~5 s."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from arborl.config import EngineConfig, SpecConfig
from arborl.engine import LLMEngine
from arborl.engine.specdec import Draft
from arborl.models import tiny_llama
from arborl.types import GenerateRequest, SamplingParams

VOCAB = 16
PROMPT = [3, 1, 4, 1, 5, 9]
N = 3000


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is faster


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit; cells expected below 5 are pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def homogeneity_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors come from one distribution."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = float(((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum())
    df = len(a) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@torch.no_grad()
def exact_distributions(model, temperature: float):
    """p(t1), p(t1, t2), p(t1, t2, t3) after PROMPT, at ``temperature``."""
    seqs = [PROMPT + list(p) for p in itertools.product(range(VOCAB), repeat=2)]
    logits = model(torch.tensor(seqs)).logits.float() / temperature
    probs = torch.softmax(logits, dim=-1)  # [256, L, V]
    n = len(PROMPT)
    p1 = probs[0, n - 1]
    p2 = probs[:: VOCAB, n].reshape(VOCAB, VOCAB)  # row t1 -> p(t2 | t1)
    p3 = probs[:, n + 1].reshape(VOCAB, VOCAB, VOCAB)  # p(t3 | t1, t2)
    joint2 = p1[:, None] * p2
    joint3 = joint2[:, :, None] * p3
    return p1, joint2, joint3


class TableDrafter:
    """Proposes the most likely continuation (2 tokens) from an exact table: a deterministic drafter,
    right often enough that many drafts are accepted and many rejected."""

    def __init__(self, joint2, joint3) -> None:
        self.next2 = joint2.argmax(-1)  # t1 -> argmax t2
        self.next3 = joint3.argmax(-1)  # (t1, t2) -> argmax t3

    def sync(self, seq) -> None:
        pass

    def propose(self, seqs, k):
        out = []
        for s in seqs:
            if len(s.output) == 1:
                t2 = int(self.next2[s.output[0]])
                out.append(Draft.chain([t2, int(self.next3[s.output[0], t2])][:k]))
            else:
                out.append(Draft())
        return out

    def release(self, seq) -> None:
        pass

    def weights_updated(self) -> None:
        pass


def sample_tokens(model, spec: bool, params: SamplingParams, drafter=None):
    cfg = EngineConfig(max_seq_len=64, max_batch_size=128, prefix_cache=False,
                       spec=SpecConfig(enabled=spec, adaptive=False, num_tokens=2))
    eng = LLMEngine(model, cfg, eos_token_ids=[VOCAB - 1])
    if drafter is not None:
        eng.spec.drafter = drafter
    res = eng.generate([GenerateRequest(list(PROMPT), replace(params, seed=1000 * spec + i)) for i in range(N)])
    return torch.tensor([r.token_ids for r in res]), eng


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_tokens=3, ignore_eos=True),
], ids=["t1", "truncated"])
def test_sampled_tokens_follow_the_policy_distribution(params):
    model = tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=5, init_std=0.6)
    p1, joint2, joint3 = exact_distributions(model, params.temperature)
    drafter = TableDrafter(joint2, joint3)
    toks, eng = sample_tokens(model, True, params, drafter)
    m = eng.spec.metrics
    assert m.drafts == N and N / 4 < m.accepted_tokens < 2 * N * 0.9  # drafts both accepted and rejected
    plain, _ = sample_tokens(model, False, params)
    # with and without speculation: the same distribution of (t2, t3) pairs
    pair = lambda t: torch.bincount(t[:, 1] * VOCAB + t[:, 2], minlength=VOCAB * VOCAB)
    assert homogeneity_pvalue(pair(toks), pair(plain)) > 0.01
    if params.top_k == 0 and params.top_p == 1.0:
        # and against the exact marginals of t2 and t3 and the joint of (t1, t2)
        assert chi2_pvalue(torch.bincount(toks[:, 1], minlength=VOCAB).double(), N * joint2.sum(0).double()) > 0.01
        assert chi2_pvalue(torch.bincount(toks[:, 2], minlength=VOCAB).double(), N * joint3.sum((0, 1)).double()) > 0.01
        assert chi2_pvalue(torch.bincount(toks[:, 0] * VOCAB + toks[:, 1], minlength=VOCAB**2).double(),
                           N * joint2.flatten().double()) > 0.01
        # the test has power: always accepting the drafts would put far too much mass on the argmax
        naive = toks.clone()
        naive[:, 1] = drafter.next2[naive[:, 0]]
        assert chi2_pvalue(torch.bincount(naive[:, 1], minlength=VOCAB).double(), N * joint2.sum(0).double()) < 1e-6
