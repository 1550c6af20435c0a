"""``scale_by_low_rank``: any optax transform run in a low-rank gradient
space, the way ``optax.contrib.scale_by_galore`` wraps its base optimizer."""

from __future__ import annotations

import functools
from typing import Any, Optional

import optax

from logra_jax.optim.dimension_numbers import SpecTree
from logra_jax.optim.moments import low_rank_moments
from logra_jax.optim.projection import project
from logra_jax.optim.projection import projection_config
from logra_jax.optim.projection import projection_spec
from logra_jax.optim.unprojection import unproject


def scale_by_low_rank(
    inner: Optional[optax.GradientTransformation] = None,
    *,
    rank: int,
    kind: str = "range",
    refresh_every: int = 200,
    power_iters: int = 1,
    oversample: int = 8,
    seed: int = 0,
    dimension_numbers: Optional[SpecTree] = None,
    mask: Any = None,
    moment_policy: str = "transfer",
    betas: tuple[float, float] = (0.9, 0.999),
    scale: float = 1.0,
    keep_factors: bool = False,
    factored: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Runs ``inner`` on rank-``r`` sketches of the gradients of matrices.

  For a weight viewed as ``G`` (``m x n``, ``m >= n``; the wide case is the
  transpose) with an orthonormal projector ``P`` (``m x r``) on its longer
  side,

  .. math::
    S = P^\top G \in \mathbb{R}^{r \times n}, \qquad
    N = \mathrm{inner}(S), \qquad
    U = \alpha P N,

  so that ``inner``'s state lives at the sketch shape
  ``[batch, r, min(m, n)]`` in float32 (``O(r \min(m, n))`` per matrix).
  ``U`` is cast to the parameter's dtype. Vectors, and whatever ``mask`` or
  ``dimension_numbers`` exclude, go through ``inner`` densely and unscaled
  (as in GaLore); so do matrices with both sides shorter than ``rank`` (e.g.
  ``2 x 3`` at ``rank=8``), as a projection could not make their moments
  smaller: :func:`logra_jax.kept_dense_paths` lists them.

  ``P`` is recomputed every ``refresh_every`` steps (and at step 0):

  * ``"range"``: randomized range finder with ``power_iters`` power
    iterations and ``oversample`` extra columns, float32 QR (Halko et al.);
  * ``"random"``: an orthonormalized Gaussian regenerated from
    ``fold_in(seed, window)`` every step, never stored (Flora);
  * ``"svd"``: the exact top-``r`` singular vectors (GaLore).

  At a refresh the moments follow the basis (``moment_policy``):

  * ``"transfer"`` (LDAdam): with :math:`C = P_{new}^\top P_{old}` and the
    bias-corrected moments :math:`\hat M, \hat V`,

    .. math::
      \hat M \leftarrow C \hat M, \qquad
      \hat V \leftarrow \max\big(0, (C \circ C)(\hat V - \hat M^2)
      + (C \hat M)^2\big),

    applied to every optax state with ``mu``/``nu`` fields (Adam-like);
    first moments without a second (``mu`` or ``trace``) rotate linearly and
    lone second moments (``nu``) map through :math:`C \circ C`;
  * ``"keep"``: moments stay as they are (GaLore);
  * ``"reset"``: moments are set to zero; the inner step count is kept.

  Sketch-direct mode: when the gradients were sketched during
  differentiation (:func:`logra_jax.value_and_sketch_grad`), the projected
  leaves of ``updates`` already hold ``S`` and the extra argument
  ``projectors`` gives this step's ``P`` (the :class:`SketchProjectors` that
  function returns); no full gradient is ever needed.

  A refreshed projector that is not finite (``"range"`` or ``"svd"``, e.g.
  from an overflow or a failed decomposition) is never used (see
  :func:`logra_jax.optim.projection.refuse_non_finite_projector`); refusals
  are counted in ``ProjectState.non_finite`` (``logra train`` logs them).
  No host callback is compiled in, so programs holding the update can be
  stored in JAX's persistent compilation cache.

  Sharding: under automatic sharding XLA lays out the state. Under explicit
  sharding (a mesh of ``jax.sharding.AxisType.Explicit`` axes set with
  ``jax.set_mesh``) the state is laid out from each parameter's type at
  ``init``: a projector split along the weight's long side, sketches and
  moments along its short side; the factorizations run under
  ``jax.sharding.auto_axes``, which gathers the ``long x (rank +
  oversample)`` columns a QR needs.

  The state is the ``optax.chain`` state of the three stages
  ``(ProjectState, LowRankMomentsState, UnprojectState)``; its structure
  depends only on the parameters' structure and shapes.

  Args:
    inner: a params-free optax transform (default
      ``optax.scale_by_adam(*betas)``).
    rank: projection rank ``r``; clipped to the shorter side of each matrix.
    kind: ``"range"``, ``"random"`` or ``"svd"``.
    refresh_every: steps between projector refreshes.
    power_iters: power iterations of the range finder.
    oversample: extra Gaussian columns of the range finder.
    seed: seed of the Gaussian test matrices and random projectors.
    dimension_numbers: None (2-d leaves are matrices), a
      :class:`DimensionNumbers`, a pytree of them (None marks dense leaves)
      or a callable of the params returning one.
    mask: pytree of bools (or callable of the params); False keeps a leaf
      dense.
    moment_policy: ``"transfer"``, ``"keep"`` or ``"reset"``.
    betas: the ``(b1, b2)`` decay rates of ``inner``'s first and second
      moments, used only by ``"transfer"`` to bias-correct before rotating.
    scale: :math:`\alpha`.
    keep_factors: also keep ``alpha * N`` of the last step in the state, so
      that :func:`logra_jax.factored_updates` gives each update as
      ``(P, alpha N)`` (for low-rank policy sync and factored KL
      prediction) at ``rank * short`` floats per matrix.
    factored: emit a :class:`FactoredDelta` ``(alpha N)`` for each projected
      leaf instead of the dense ``alpha P N``, for params kept factored
      (:mod:`logra_jax.optim.factored`); no ``m x n`` update is formed.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its extra argument
    ``projectors`` is read in sketch-direct mode, the others go to ``inner``.

  Example:
    >>> import jax.numpy as jnp, optax, logra_jax as logra
    >>> params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    >>> tx = optax.chain(
    ...     logra.scale_by_low_rank(optax.scale_by_lion(), rank=4),
    ...     optax.scale_by_learning_rate(1e-3))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> updates["w"].shape, state[0][1].inner_state.mu["w"].shape
    ((64, 32), (1, 4, 32))

  References:
    Zhao et al., `GaLore <https://arxiv.org/abs/2403.03507>`_, 2024;
    Hao et al., `Flora <https://arxiv.org/abs/2402.03293>`_, 2024;
    Robert et al., `LDAdam <https://arxiv.org/abs/2410.16103>`_, 2024;
    Halko, Martinsson & Tropp, `Finding structure with randomness
    <https://arxiv.org/abs/0909.4061>`_, 2011.
  """
  checked_rank, config = projection_config(
      rank, kind, refresh_every, power_iters, oversample, seed, moment_policy
  )
  spec_of = functools.partial(
      projection_spec,
      rank=checked_rank,
      config=config,
      dimension_numbers=dimension_numbers,
      mask=mask,
  )
  return optax.chain(
      project(spec_of, checked_rank, config),
      low_rank_moments(inner, betas, spec_of),
      unproject(
          spec_of, scale=scale, keep_factors=keep_factors, factored=factored
      ),
  )
