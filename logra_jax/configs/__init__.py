"""Typed run configuration: the schema (frozen dataclasses) and its loading
(presets, YAML run configs and overrides)."""

from logra_jax.configs.schema import ADVANTAGES
from logra_jax.configs.loss import AGGREGATIONS
from logra_jax.configs.schema import CHAT_TEMPLATES
from logra_jax.configs.schema import check_kl_subsample
from logra_jax.configs.schema import CheckpointConfig
from logra_jax.configs.optimizer import GRADIENT_MODES
from logra_jax.configs.loss import IMPORTANCE_LEVELS
from logra_jax.configs.loss import KL_ESTIMATORS
from logra_jax.configs.schema import LoggingConfig
from logra_jax.configs.loss import LossConfig
from logra_jax.configs.optimizer import OptimizerConfig
from logra_jax.configs.optimizer import OPTIMIZERS
from logra_jax.configs.loss import POLICY_LOSSES
from logra_jax.configs.schema import PolicyConfig
from logra_jax.configs.schema import RewardConfig
from logra_jax.configs.rollout import ROLLOUT_DTYPES
from logra_jax.configs.rollout import ROLLOUT_ENGINES
from logra_jax.configs.rollout import RolloutConfig
from logra_jax.configs.schema import SyncConfig
from logra_jax.configs.schema import TaskConfig
from logra_jax.configs.schema import TRACKERS
from logra_jax.configs.schema import TrainConfig
from logra_jax.configs.loading import apply_overrides
from logra_jax.configs.loading import from_dict
from logra_jax.configs.loading import get_preset
from logra_jax.configs.loading import load_config
from logra_jax.configs.loading import PRESET_DIR
from logra_jax.configs.loading import preset_names
from logra_jax.configs.loading import RECIPE_DIR
from logra_jax.configs.loading import recipe_names
from logra_jax.configs.loading import to_dict
from logra_jax.configs.loading import to_yaml

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "apply_overrides",
    "CHAT_TEMPLATES",
    "CheckpointConfig",
    "from_dict",
    "get_preset",
    "GRADIENT_MODES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "load_config",
    "LoggingConfig",
    "LossConfig",
    "OptimizerConfig",
    "OPTIMIZERS",
    "POLICY_LOSSES",
    "PolicyConfig",
    "PRESET_DIR",
    "preset_names",
    "RECIPE_DIR",
    "recipe_names",
    "RewardConfig",
    "ROLLOUT_DTYPES",
    "ROLLOUT_ENGINES",
    "RolloutConfig",
    "SyncConfig",
    "TaskConfig",
    "to_dict",
    "to_yaml",
    "TRACKERS",
    "TrainConfig",
]
