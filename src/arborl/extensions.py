"""The config knobs that name an extension point, their registries, and the check that every such
name resolves before a job starts (a typo fails in a second, naming the key, not after the model loaded)."""

from __future__ import annotations

from arborl.agents import AGENTS
from arborl.config import Config, ConfigError
from arborl.engine.backends import ENGINE_BACKENDS
from arborl.engine.specdec import DRAFTERS
from arborl.registry import Registry, RegistryError
from arborl.rewards import ADVANTAGE_ESTIMATORS, resolve_estimator
from arborl.scheduling.consume import CONSUME_POLICIES
from arborl.scheduling.dispatch import DISPATCH_POLICIES
from arborl.tasks import TASK_SUITES
from arborl.tasks.reward_fn import REWARD_FUNCTIONS
from arborl.train.losses import resolve_loss
from arborl.train.policy_losses import POLICY_LOSSES

# knob (dotted key path) -> the registry its value is looked up in
REGISTRY_KNOBS: dict[str, Registry] = {
    "rollout.task": TASK_SUITES,
    "rollout.agent": AGENTS,
    "rollout.data.reward_function": REWARD_FUNCTIONS,
    "train.loss.kind": POLICY_LOSSES,
    "train.advantage.estimator": ADVANTAGE_ESTIMATORS,
    "scheduling.consume": CONSUME_POLICIES,
    "scheduling.dispatch": DISPATCH_POLICIES,
    "engine.spec.drafter": DRAFTERS,
    "engine.backend": ENGINE_BACKENDS,
}

# a kind's own settings: settings key -> (the knob choosing the kind, its registry)
KIND_SETTINGS: dict[str, tuple[str, Registry]] = {
    "train.loss.settings": ("train.loss.kind", POLICY_LOSSES),
    "train.advantage.settings": ("train.advantage.estimator", ADVANTAGE_ESTIMATORS),
}


def kind_setting_keys() -> set[str]:
    """``<settings key>.<name>`` of every setting of every registered kind (``train.loss.settings.clip_high``)."""
    out = set()
    for key, (_, registry) in KIND_SETTINGS.items():
        for kind in registry.names():
            model = getattr(registry.get(kind), "Settings", None)
            out |= {f"{key}.{name}" for name in (model.model_fields if model is not None else ())}
    return out


def knob_value(cfg: Config, key: str) -> str:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return str(node)


def check_extensions(cfg: Config) -> None:
    """Resolve every extension knob of ``cfg``; a name that is neither registered nor a loadable path
    raises ConfigError naming the key. The loss's and the estimator's own settings (``train.loss.settings``,
    ``train.advantage.settings``) are validated by the chosen kind's model: a ConfigError names the setting."""
    for key, registry in REGISTRY_KNOBS.items():
        try:
            registry.get(knob_value(cfg, key))
        except RegistryError as e:
            raise ConfigError(f"{key}: {e}") from None
    resolve_loss(cfg.train.loss)
    resolve_estimator(cfg.train.advantage)
