"""engine.sampling.sample: the log-probs it records for each row are the same bits whatever the other
rows of its batch sample with (greedy, another temperature, top-k), and each is log softmax(logits)[token]."""

from __future__ import annotations

import torch

from arborl.engine.sampling import log_probs, position_uniform, sample
from arborl.types import SamplingParams


def _logits(n: int) -> torch.Tensor:
    return torch.randn(n, 4096, generator=torch.Generator().manual_seed(n)) * 6


def test_a_rows_tokens_and_log_probs_do_not_depend_on_how_the_other_rows_sample():
    logits = _logits(6)
    t1 = SamplingParams(temperature=1.0, max_tokens=4)
    batches = {
        "all at T=1": [t1] * 6,
        "mixed": [t1, SamplingParams(temperature=0.0, max_tokens=4), t1, SamplingParams(temperature=0.7, top_k=50,
                                                                                            max_tokens=4), t1, t1],
    }
    seeds, positions = list(range(6)), [9] * 6
    out = {name: sample(logits, params, seeds, positions) for name, params in batches.items()}
    for i in (0, 2, 4, 5):  # the T=1 rows: same token, same log-probs bits, in either batch
        assert out["all at T=1"].tokens[i] == out["mixed"].tokens[i]
        assert out["all at T=1"].logprobs[i] == out["mixed"].logprobs[i]
        assert out["all at T=1"].sample_logprobs[i] == out["mixed"].sample_logprobs[i]
    want = log_probs(logits)
    for name, res in out.items():
        for i, (tok, lp) in enumerate(zip(res.tokens, res.logprobs)):
            assert lp == float(want[i, tok]), (name, i)
    mixed = out["mixed"]
    assert mixed.tokens[1] == int(logits[1].argmax()) and mixed.sample_logprobs[1] == 0.0
    assert mixed.sample_logprobs[3] != mixed.logprobs[3]  # T=0.7 and top-k: another distribution


def test_the_draw_is_the_inverse_cdf_of_the_positions_uniform():
    logits = _logits(3)
    res = sample(logits, [SamplingParams(temperature=1.0, max_tokens=2)] * 3, [11, 12, 13], [4, 4, 4])
    p = torch.softmax(logits.double(), -1)
    for i, tok in enumerate(res.tokens):
        u = position_uniform(11 + i, 4)
        cdf = torch.cumsum(p[i], 0)
        assert float(cdf[tok - 1] if tok else 0.0) <= u + 1e-9 and u <= float(cdf[tok]) + 1e-9
