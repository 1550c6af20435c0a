"""Typed run configuration and named presets."""

from logra_jax.configs.train import apply_overrides
from logra_jax.configs.train import get_preset
from logra_jax.configs.train import OptimizerConfig
from logra_jax.configs.train import PolicyConfig
from logra_jax.configs.train import PRESETS
from logra_jax.configs.train import RolloutConfig
from logra_jax.configs.train import TaskConfig
from logra_jax.configs.train import TrainConfig
