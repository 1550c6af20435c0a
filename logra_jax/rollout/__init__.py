"""The rollout engine (:mod:`logra_jax.rollout.engine`)."""
