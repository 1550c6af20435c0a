"""Tolerances for float results that are summed in a different order.

Floating-point addition is not associative, so two programs that compute the
same sum in different orders (another fusion, tiling, chunking or machine)
may differ in the last bits. The standard bound (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., 2002, Lemma 3.1 and eq. 3.5): a
sum of ``n`` terms, evaluated in any order, satisfies

  |fl(x_1 + ... + x_n) - (x_1 + ... + x_n)| <= gamma_n * sum_i |x_i|,
  gamma_n = n * u / (1 - n * u),

with ``u`` the unit roundoff (half the machine epsilon under round to
nearest); a dot product or a matrix product with inner length ``n`` obeys the
same bound with ``|x_i|`` the absolute products. Two evaluations in different
orders are each that close to the exact sum, so they differ by at most
``2 * gamma_n * sum_i |x_i|``. Chained reductions (a network: norms, matmuls,
softmax) compose to first order: take ``n`` as the sum of the reduction
lengths along the chain.

Use this where the same math runs in another order; compare with
``assert_array_equal`` where the same computation runs twice (a bit-identity
claim), and with hand-derived values where the math differs.
"""

import jax.numpy as jnp


def unit_roundoff(dtype) -> float:
  """``u``: half the machine epsilon of ``dtype`` (round to nearest)."""
  return float(jnp.finfo(dtype).eps) / 2


def float_tolerance(dtype, reduction_length: int) -> float:
  """``gamma_n = n u / (1 - n u)`` for ``n = reduction_length`` terms.

  The bound on the relative error of a sum of ``n`` terms in ``dtype``,
  relative to the sum of their magnitudes; twice it bounds the difference of
  two evaluations in different orders.

  Args:
    dtype: the floating dtype the sum is accumulated in (``jnp.bfloat16``
      included).
    reduction_length: ``n``, the number of terms (>= 1).

  Returns:
    ``gamma_n`` as a Python float.

  Raises:
    ValueError: if ``n u >= 1``, where the bound says nothing.

  Example:
    >>> round(float_tolerance(jnp.float32, 1024) / jnp.finfo(jnp.float32).eps)
    512
  """
  if reduction_length < 1:
    raise ValueError(f"reduction_length must be >= 1, got {reduction_length}")
  nu = reduction_length * unit_roundoff(dtype)
  if nu >= 1:
    raise ValueError(
        f"no error bound for {reduction_length} terms in {jnp.dtype(dtype)}: "
        f"n * u = {nu:.3g} >= 1"
    )
  return nu / (1 - nu)


def decoder_reduction_length(config, length: int) -> int:
  """Terms summed along the float32 chain from the weights to one logit.

  For a ``logra_jax.models.DecoderConfig`` and ``length`` positions, per
  layer: two RMS norms over D, scores over h, softmax and values over the
  keys, o_proj over H * h, gate/up over D, down over F; then the final norm
  and the unembedding over D. First-order error analysis adds the lengths of
  chained reductions, so ``2 * gamma_n`` of the logits' magnitude bounds two
  evaluations of the forward pass in different orders; a backward pass
  doubles ``n`` and a gradient adds the tokens it sums over.
  """
  c = config
  layer = (
      2 * c.hidden_size
      + c.head_dim
      + 2 * length
      + c.num_heads * c.head_dim
      + c.hidden_size
      + c.intermediate_size
  )
  return c.num_layers * layer + 2 * c.hidden_size
