"""Training: samples from recorded calls (``samples``), policy-gradient losses (``losses``),
training-inference mismatch corrections (``corrections``), packing (``packing``, flat and tree) and
the trainer (``trainer``) that runs them; ``checkpoint`` saves and resumes it."""

from arborl.train.corrections import rollout_correction
from arborl.train.losses import (
    aggregate,
    cispo_token_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    ppo_clip_token_loss,
    token_logprobs,
)

__all__ = [
    "aggregate",
    "cispo_token_loss",
    "entropy_from_logits",
    "kl_penalty",
    "policy_loss",
    "ppo_clip_token_loss",
    "rollout_correction",
    "token_logprobs",
]
