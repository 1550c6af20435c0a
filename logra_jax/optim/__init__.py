"""Optax transforms of LoGRA: usable alone as an optax extension."""

from logra_jax.optim.alias import logra
from logra_jax.optim.dimension_numbers import DimensionNumbers
from logra_jax.optim.dimension_numbers import LeafPlan
from logra_jax.optim.kl_control import KLPredictor
from logra_jax.optim.kl_control import make_kl_predictor
from logra_jax.optim.kl_control import predicted_kl_state
from logra_jax.optim.kl_control import scale_by_predicted_kl
from logra_jax.optim.kl_control import ScaleByPredictedKLState
from logra_jax.optim.transforms import factored_updates
from logra_jax.optim.transforms import FactoredUpdate
from logra_jax.optim.transforms import low_rank_moments
from logra_jax.optim.transforms import LowRankMomentsState
from logra_jax.optim.transforms import optimizer_state_bytes
from logra_jax.optim.transforms import project
from logra_jax.optim.transforms import ProjectState
from logra_jax.optim.transforms import Sketched
from logra_jax.optim.transforms import SketchProjectors
from logra_jax.optim.transforms import unproject
from logra_jax.optim.transforms import UnprojectState
