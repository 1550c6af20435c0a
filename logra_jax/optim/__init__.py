"""Optax transforms of LoGRA: usable alone as an optax extension."""

from logra_jax.optim.alias import logra
from logra_jax.optim.dimension_numbers import DimensionNumbers
from logra_jax.optim.dimension_numbers import LeafPlan
from logra_jax.optim.kl_control import KLPredictor
from logra_jax.optim.kl_control import make_kl_predictor
from logra_jax.optim.kl_control import predicted_kl_state
from logra_jax.optim.kl_control import scale_by_predicted_kl
from logra_jax.optim.kl_control import ScaleByPredictedKLState
from logra_jax.optim.low_rank_space import scale_by_low_rank
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
