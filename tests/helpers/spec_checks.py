"""Checks shared by the speculative-decoding tests."""

from __future__ import annotations

import torch

from arborl.engine.sampling import log_probs


def assert_policy_logprobs(plain_engine, results, atol: float = 1e-5) -> None:
    """Every recorded log-prob of ``results`` is the policy's: one plain forward over each stream (the
    ``plain_engine``'s runner, no speculation) gives the same values within ``atol``."""
    for r in results:
        full = r.prompt_token_ids + r.token_ids
        logits = plain_engine.runner.verify([(0, 0, full[:-1], list(range(-1, len(full) - 2)))])[0].float()
        n = len(r.prompt_token_ids)
        lp = log_probs(logits[n - 1 :])[torch.arange(len(r.token_ids)), torch.tensor(r.token_ids)]
        assert (lp - torch.tensor(r.logprobs)).abs().max() <= atol
