"""Training: samples from recorded calls (``samples``), the trainer's loss (``losses``: aggregation, KL,
``policy_loss``), the registered token losses with their settings (``policy_losses``: PPO, CISPO, SFT, GSPO,
GMPO, SAPO, Clip-Cov, KL-Cov, IPA), the importance ratio (``ratio``), training-inference mismatch and
decoupled-PPO weights (``corrections``), packing (``packing``, flat and tree) and the trainer
(``trainer``) that runs them; ``checkpoint`` saves and resumes it."""

from arborl.train.corrections import decoupled_weights, rollout_correction
from arborl.train.losses import (
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    resolve_loss,
    token_logprobs,
)
from arborl.train.policy_losses import (
    POLICY_LOSSES,
    cispo_token_loss,
    clip_cov_token_loss,
    gmpo_token_loss,
    gspo_token_loss,
    ipa_token_loss,
    kl_cov_token_loss,
    ppo_clip_token_loss,
    sapo_token_loss,
    sft_token_loss,
)

__all__ = [
    "POLICY_LOSSES",
    "aggregate",
    "cispo_token_loss",
    "clip_cov_token_loss",
    "decoupled_weights",
    "entropy_from_logits",
    "gmpo_token_loss",
    "gspo_token_loss",
    "ipa_token_loss",
    "kl_cov_token_loss",
    "kl_penalty",
    "policy_loss",
    "ppo_clip_token_loss",
    "resolve_loss",
    "rollout_correction",
    "sapo_token_loss",
    "sft_token_loss",
    "token_logprobs",
]
