r"""The frozen reference policy of a KL-to-reference penalty (``loss.beta > 0``).

GRPO's usual loss adds :math:`\beta\,\mathrm{KL}(\pi_\theta \| \pi_{ref})`,
with :math:`\pi_{ref}` the policy RL started from. The run keeps a frozen copy
of the initial weights in ``policy.reference_dtype`` (bfloat16 by default: 2
bytes per parameter, half of a float32 master copy), laid out like the
policy's parameters, and computes the reference log-probabilities of each
rollout batch once, outside the gradient, in a compiled program of their own;
the learner's step then reads them from ``RolloutBatch.ref_logp_BxT``.
"""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp

from logra_jax import models
from logra_jax import parallel
from logra_jax.rl import algo


def reference_params(params: nnx.State, dtype: Any) -> nnx.State:
  """A frozen copy of ``params`` in ``dtype`` (floating leaves only), with the
  same shardings: the reference policy's weights.

  Example:
    >>> import jax.numpy as jnp
    >>> ref = reference_params({"w": jnp.ones((2, 3))}, jnp.bfloat16)
    >>> ref["w"].dtype
    dtype(bfloat16)
  """
  dtype = jnp.dtype(dtype)

  def freeze(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.copy(x)
    return x.astype(dtype) if x.dtype != dtype else jnp.copy(x)

  return jax.tree.map(freeze, params)


def make_reference_logprobs(
    graphdef: nnx.GraphDef,
    temperature: float,
    shardings: tuple[Any, Any] | None = None,
    activation_rules: dict[str, Any] | None = None,
) -> Callable[[nnx.State, algo.RolloutBatch], algo.RolloutBatch]:
  """Builds the jitted ``(ref_params, batch) -> batch`` that fills
  ``batch.ref_logp_BxT`` with float32 log-probabilities of the completion
  tokens under the reference policy.

  The same log-probabilities as the learner's (``models.token_logprobs`` at
  the rollout ``temperature``), computed from the reference weights as
  stored: in bfloat16 they are rounded, so at step 0 the reference KL is of
  the order of that rounding, not exactly 0.

  Args:
    graphdef: the policy's graph definition (``models.split_model``).
    temperature: the rollout temperature (the learner divides logits by it).
    shardings: optional ``(ref_params, batch)`` shardings (trees of
      ``NamedSharding`` from :mod:`logra_jax.parallel`); the output batch has
      the batch's sharding, ``ref_logp_BxT`` split like the completions.
    activation_rules: logical axis -> mesh axes, with ``shardings``.

  Returns:
    The jitted function.

  Example:
    >>> from logra_jax import models
    >>> model = models.init_model(models.DecoderConfig.tiny(vocab_size=16))
    >>> graphdef, params = models.split_model(model)
    >>> z = jnp.ones((2, 3), jnp.int32)
    >>> batch = algo.RolloutBatch(
    ...     prompt_tokens_BxP=z, prompt_mask_BxP=z, completion_tokens_BxT=z,
    ...     completion_mask_BxT=z, old_logp_BxT=z * 0.0,
    ...     advantages_B=z[:, 0] * 0.0, num_generations=2)
    >>> fill = make_reference_logprobs(graphdef, temperature=1.0)
    >>> fill(reference_params(params, jnp.bfloat16), batch).ref_logp_BxT.shape
    (2, 3)
  """

  def fill(ref_params, batch: algo.RolloutBatch) -> algo.RolloutBatch:
    logp_BxT = models.token_logprobs(
        graphdef,
        ref_params,
        batch.prompt_tokens_BxP,
        batch.prompt_mask_BxP,
        batch.completion_tokens_BxT,
        batch.completion_mask_BxT,
        context_mask_BxN=batch.context_mask_BxT,
        temperature=temperature,
    )
    return batch.replace(ref_logp_BxT=logp_BxT.astype(jnp.float32))

  if shardings is None:
    return jax.jit(fill)
  params_sharding, batch_sharding = shardings
  mesh = jax.tree.leaves(params_sharding)[0].mesh
  out_sharding = batch_sharding.replace(
      ref_logp_BxT=batch_sharding.completion_mask_BxT
  )

  def sharded_fill(ref_params, batch):
    with parallel.activation_sharding(mesh, activation_rules):
      return fill(ref_params, batch)

  return jax.jit(
      sharded_fill,
      in_shardings=(params_sharding, batch_sharding),
      out_shardings=out_sharding,
  )
