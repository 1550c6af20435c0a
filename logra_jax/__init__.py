"""logra-jax: memory-efficient RL post-training with low-rank gradient sketches."""

from logra_jax.optim import DimensionNumbers
from logra_jax.optim import factored_updates
from logra_jax.optim import FactoredUpdate
from logra_jax.optim import logra
from logra_jax.optim import make_kl_predictor
from logra_jax.optim import predicted_kl_state
from logra_jax.optim import scale_by_predicted_kl
from logra_jax.optim import low_rank_moments
from logra_jax.optim import optimizer_state_bytes
from logra_jax.optim import project
from logra_jax.optim import SketchProjectors
from logra_jax.optim import unproject
from logra_jax.optim.sketch_grad import value_and_sketch_grad

__version__ = "0.1.0"
