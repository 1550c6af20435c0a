"""logra-jax: memory-efficient RL post-training with low-rank gradient sketches.

The public surface: the optax transforms of LoGRA and their state types, the
``logra`` alias, the low-rank weight ops models call, sketch-direct gradients
and the predicted-KL step control.
"""

import importlib.metadata

from logra_jax.lowrank import LowRankDelta
from logra_jax.lowrank import matmul
from logra_jax.lowrank import take
from logra_jax.optim.alias import logra
from logra_jax.optim.dimension_numbers import DimensionNumbers
from logra_jax.optim.kl_control import KLPredictor
from logra_jax.optim.kl_control import make_kl_predictor
from logra_jax.optim.kl_control import predicted_kl_state
from logra_jax.optim.kl_control import scale_by_predicted_kl
from logra_jax.optim.kl_control import ScaleByPredictedKLState
from logra_jax.optim.low_rank_space import scale_by_low_rank
from logra_jax.optim.sketch_grad import value_and_sketch_grad
from logra_jax.optim.state_queries import factored_updates
from logra_jax.optim.state_queries import kept_dense_paths
from logra_jax.optim.state_queries import optimizer_state_bytes
from logra_jax.optim.types import FactoredDelta
from logra_jax.optim.types import FactoredUpdate
from logra_jax.optim.types import LowRankMomentsState
from logra_jax.optim.types import ProjectState
from logra_jax.optim.types import Sketched
from logra_jax.optim.types import SketchProjectors
from logra_jax.optim.types import UnprojectState

__version__ = importlib.metadata.version("logra-jax")

__all__ = (
    "DimensionNumbers",
    "FactoredDelta",
    "FactoredUpdate",
    "KLPredictor",
    "LowRankDelta",
    "LowRankMomentsState",
    "ProjectState",
    "ScaleByPredictedKLState",
    "SketchProjectors",
    "Sketched",
    "UnprojectState",
    "factored_updates",
    "kept_dense_paths",
    "logra",
    "make_kl_predictor",
    "matmul",
    "optimizer_state_bytes",
    "predicted_kl_state",
    "scale_by_low_rank",
    "scale_by_predicted_kl",
    "take",
    "value_and_sketch_grad",
)
