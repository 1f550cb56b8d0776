"""One pydantic config tree, YAML files and ``--set a.b=c`` overrides.

Each section's model sits in the module named after what it configures (``config/engine.py`` for
``engine.*``, ``config/train.py`` for ``train.*``, ...); ``config/root.py`` assembles them into
:class:`Config` and loads, overrides and dumps it. Every knob has a type, a default and a one-line
description (with its unit); docs/knobs.md is generated from these models by
``python scripts/docs_knobs.py``.
"""

from arborl.config.base import ConfigError, Section
from arborl.config.cluster import ClusterConfig
from arborl.config.engine import EngineConfig, SGLangConfig, SpecConfig, VLLMConfig
from arborl.config.datapool import DataPoolConfig
from arborl.config.gateway import GatewayConfig
from arborl.config.model import ModelConfig
from arborl.config.report import ReportConfig
from arborl.config.rollout import (CodeRepairConfig, DataConfig, EnvsConfig, GymConfig, HarborConfig, JudgeConfig,
                                   RolloutConfig, VerifiersConfig)
from arborl.config.root import (GROUP_RELATIVE_ESTIMATORS, Config, apply_overrides, dump_config, known_keys,
                                load_config, load_data, parse_override, validate_config)
from arborl.config.scheduling import SchedulingConfig
from arborl.config.sim import SimConfig
from arborl.config.train import (MOVED_LOSS_KEYS, AdvantageConfig, CorrectionConfig, LossConfig, MTPTrainConfig,
                                 ParallelConfig, RejectionConfig, RewardShapingConfig, SFTConfig, TrainConfig)

__all__ = [
    "AdvantageConfig", "ClusterConfig", "CodeRepairConfig", "Config", "ConfigError", "CorrectionConfig",
    "DataConfig", "DataPoolConfig", "EngineConfig", "EnvsConfig", "GROUP_RELATIVE_ESTIMATORS", "GatewayConfig",
    "GymConfig", "HarborConfig", "JudgeConfig", "LossConfig", "MOVED_LOSS_KEYS", "MTPTrainConfig", "ModelConfig",
    "ParallelConfig", "RejectionConfig", "ReportConfig", "RewardShapingConfig", "RolloutConfig", "SFTConfig",
    "SGLangConfig", "SchedulingConfig", "Section", "SimConfig", "SpecConfig", "TrainConfig", "VLLMConfig",
    "VerifiersConfig", "apply_overrides", "dump_config", "known_keys", "load_config", "load_data",
    "parse_override", "validate_config",
]
