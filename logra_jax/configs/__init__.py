"""Typed run configuration: presets, YAML run configs and overrides."""

from logra_jax.configs.train import apply_overrides
from logra_jax.configs.train import get_preset
from logra_jax.configs.train import load_config
from logra_jax.configs.train import LoggingConfig
from logra_jax.configs.train import LossConfig
from logra_jax.configs.train import OptimizerConfig
from logra_jax.configs.train import PolicyConfig
from logra_jax.configs.train import preset_names
from logra_jax.configs.train import RewardConfig
from logra_jax.configs.train import RolloutConfig
from logra_jax.configs.train import TaskConfig
from logra_jax.configs.train import TrainConfig
