"""Orthonormal projectors: random, randomized range finder, exact SVD.

All functions act on a batch of matrices and return ``[batch, long, rank]``
projectors with orthonormal columns, computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KINDS = ("range", "random", "svd")


def window_key(seed: int, leaf_index: int, window: jax.Array) -> jax.Array:
  """The PRNG key of one leaf for one refresh window."""
  key = jax.random.fold_in(jax.random.key(seed), leaf_index)
  return jax.random.fold_in(key, window)


def _batched(fn):
  """``fn`` of one matrix, applied to a batch of them.

  On CPU one matrix per LAPACK call (``lax.map``): jaxlib's CPU kernels split
  a batch over XLA's intra-op thread pool and block a pool thread until the
  pieces are done, so independent batched QRs or SVDs running at once (one
  per weight) can occupy every pool thread and wait on each other forever.
  One matrix per call runs inline. Elsewhere one batched call (``vmap``).
  """

  def apply(x_BxMxN):
    return jax.lax.platform_dependent(
        x_BxMxN, cpu=lambda x: jax.lax.map(fn, x), default=jax.vmap(fn)
    )

  return apply


# Orthonormal basis of each matrix's columns (QR), and the thin SVD.
orthonormal_columns = _batched(lambda y_LxK: jnp.linalg.qr(y_LxK)[0])
thin_svd = _batched(lambda x: jnp.linalg.svd(x, full_matrices=False))


def random_projector(
    key: jax.Array, batch: int, long: int, rank: int
) -> jax.Array:
  """Orthonormalized Gaussian ``[batch, long, rank]`` (Flora-style).

  Regenerable from ``key``, so it never needs to be stored or sent.
  """
  omega = jax.random.normal(key, (batch, long, rank), jnp.float32)
  return orthonormal_columns(omega)


def range_projector(
    g_BxLxS: jax.Array,
    key: jax.Array,
    rank: int,
    oversample: int,
    power_iters: int,
) -> jax.Array:
  r"""Randomized range finder (Halko, Martinsson & Tropp, 2011).

  With a Gaussian test matrix :math:`\Omega` (``short x (rank + p)``):
  :math:`Q = \mathrm{qr}((G G^\top)^q G \Omega)`, orthonormalized after every
  multiplication; then the top ``rank`` left singular vectors of the small
  matrix :math:`Q^\top G` rotate :math:`Q` so that its first columns carry the
  most energy: :math:`P = Q U_{:, :r}`.
  """
  g = g_BxLxS.astype(jnp.float32)
  batch, _, short = g.shape
  width = min(rank + oversample, short)
  omega_BxSxK = jax.random.normal(key, (batch, short, width), jnp.float32)
  q_BxLxK = orthonormal_columns(g @ omega_BxSxK)
  for _ in range(power_iters):
    z_BxSxK = orthonormal_columns(jnp.swapaxes(g, 1, 2) @ q_BxLxK)
    q_BxLxK = orthonormal_columns(g @ z_BxSxK)
  small_BxKxS = jnp.swapaxes(q_BxLxK, 1, 2) @ g
  u_BxKxK, _, _ = thin_svd(small_BxKxS)
  return q_BxLxK @ u_BxKxK[:, :, :rank]


def svd_projector(g_BxMxN: jax.Array, rank: int, left: bool) -> jax.Array:
  """Exact top-``rank`` singular vectors on the longer side (GaLore).

  Takes the matrix in its own orientation ``[batch, m, n]`` and returns the
  left singular vectors when ``left`` (``m >= n``), else the right ones.
  """
  u, _, vh = thin_svd(g_BxMxN.astype(jnp.float32))
  if left:
    return u[:, :, :rank]
  return jnp.swapaxes(vh, 1, 2)[:, :, :rank]
