"""RL post-training: rewards, GRPO-family losses, the learner and the run."""

from logra_jax.rl.algo import compute_advantages
from logra_jax.rl.algo import LossConfig
from logra_jax.rl.algo import RolloutBatch
