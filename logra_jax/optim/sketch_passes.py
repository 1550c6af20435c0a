"""The backward passes of sketch-direct gradients: thin products of every
projected gradient, and the randomized range finder run on them."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from logra_jax import lowrank
from logra_jax.lowrank import LowRankDelta
from logra_jax.optim import projectors as proj_lib
from logra_jax.optim.dimension_numbers import LeafPlan


class Passes:
  """Backward passes that return thin products of every projected gradient.

  In terms of the long view ``Gl`` of a gradient (``[batch, long, short]``,
  ``G`` or ``G^T``): ``long(Q)`` returns ``Q^T Gl`` (``[batch, k, short]``,
  the sketch when ``Q = P``) and ``short(Omega)`` returns ``Gl Omega``
  (``[batch, long, k]``). Both also return the loss value and the ordinary
  gradients of the dense leaves.
  """

  def __init__(
      self, loss_fn, has_aux, value_and_grad, spec, params_flat, args, constrain
  ):
    """``value_and_grad(fn, has_aux=...)`` differentiates (``jax``'s, or a
    sum over micro-batches)."""
    self.loss_fn, self.has_aux, self.constrain = loss_fn, has_aux, constrain
    self.value_and_grad = value_and_grad
    self.spec, self.params_flat, self.args = spec, params_flat, args

  def _grad(self, fn, diff):
    return self.value_and_grad(fn, has_aux=self.has_aux)(diff, *self.args)

  def _run(self, mats: list, long_side: bool):
    plans, params_flat = self.spec.plans, self.params_flat
    # rows=True: W + F Z (dZ = F^T G); rows=False: W + Z F^T (dZ = G F).
    rows = [plan.left == long_side for plan in plans]
    coords0 = []
    for plan, mat, r in zip(plans, mats, rows):
      if not plan.projected:
        coords0.append(None)
        continue
      batch_shape, k = plan.shape[:-2], mat.shape[-1]
      z = jnp.zeros(
          batch_shape + ((k, plan.n) if r else (plan.m, k)), jnp.float32
      )
      coords0.append(z)
    dense0 = [
        None if plan.projected else p for plan, p in zip(plans, params_flat)
    ]

    def lifted_loss(diff, *args):
      dense, coords = diff
      leaves = []
      for plan, p, d, mat, z, r in zip(
          plans, params_flat, dense, mats, coords, rows
      ):
        if not plan.projected:
          leaves.append(d)
          continue
        factor = self._split_large_axis(
            mat.reshape(plan.shape[:-2] + mat.shape[-2:]), -2
        )
        # Constrained here, where it is differentiated, so that its
        # cotangent (accumulated over the layers' scan) is split too.
        z = self._split_large_axis(z, -1 if r else -2)
        leaves.append(
            LowRankDelta(p, factor, z, rows=r, path=plan.path, at_zero=True)
        )
      with lowrank.recording_uses() as consumed:
        out = self.loss_fn(self.spec.treedef.unflatten(leaves), *args)
      unused = [
          plan.path
          for plan in plans
          if plan.projected and plan.path not in consumed
      ]
      if unused:
        raise ValueError(
            f"the loss never used projected parameters {unused[:5]} through "
            "logra_jax.lowrank.matmul or take: it must take the params as "
            "its first argument and use them (not close over another copy), "
            "and the model must apply those weights with matmul or take"
        )
      return out

    value, (dense_grads, coord_grads) = self._grad(
        lifted_loss, (dense0, coords0)
    )
    products = []
    for plan, g, r in zip(plans, coord_grads, rows):
      if not plan.projected:
        products.append(None)
        continue
      g = g.reshape((plan.batch,) + g.shape[-2:])
      # long pass: rows gives F^T G = [k, n] = Q^T Gl (left); cols gives
      # G F = [m, k] = (Q^T Gl)^T (right). Short pass: the mirror image.
      products.append(g if r == long_side else jnp.swapaxes(g, 1, 2))
    return value, dense_grads, products

  def _split_large_axis(self, x, axis: int):
    axes = [None] * x.ndim
    axes[axis] = "sketch_long"
    return self.constrain(x, tuple(axes))

  def long(self, q_BxLxK: list):
    return self._run(q_BxLxK, long_side=True)

  def short(self, omega_BxSxK: list):
    return self._run(omega_BxSxK, long_side=False)

  def dense_svd(self, refuse: Callable):
    """Dense-gradient fallback of ``kind="svd"`` refresh steps; ``refuse``
    replaces non-finite projectors (see :func:`value_and_sketch_grad`)."""
    params = self.spec.treedef.unflatten(
        [
            p.dense() if isinstance(p, LowRankDelta) else p
            for p in self.params_flat
        ]
    )
    value, grads = self._grad(self.loss_fn, params)
    grads_flat = self.spec.treedef.flatten_up_to(grads)
    projectors, refused = refuse(
        [
            proj_lib.svd_projector(plan.to_matrix(g), plan.rank, plan.left)
            if plan.projected
            else None
            for plan, g in zip(self.spec.plans, grads_flat)
        ]
    )
    sketches = [
        None if p is None else plan.sketch(p, g)
        for plan, p, g in zip(self.spec.plans, projectors, grads_flat)
    ]
    dense = [
        None if plan.projected else g
        for plan, g in zip(self.spec.plans, grads_flat)
    ]
    return value, dense, sketches, projectors, refused


def range_steps(
    passes: Passes, old_projectors: list, window, refresh, refuse: Callable
):
  """One step of ``kind="range"``: the sketch, and on refresh steps the new
  projector from the randomized range finder run on thin gradient products.

  All passes run in one ``lax.while_loop`` whose body picks a long or short
  pass with ``lax.cond``, so the program holds two copies of the backward
  pass whatever ``power_iters`` is. Non-refresh steps run one long pass with
  the stored projector (padded to the range finder's width). Refresh steps
  run the range finder of :func:`projectors.range_projector` exactly:
  ``Q = qr(Gl Omega)``, then per power iteration ``Z = qr(Gl^T Q)``,
  ``Q = qr(Gl Z)``, and a last ``Q^T Gl`` that gives both the rotation to the
  top singular directions and the sketch. If ``refuse`` replaces a rotated
  projector that is not finite, one more long pass takes the sketches with
  the projectors in use.
  """
  config = passes.spec.config
  plans = passes.spec.plans
  widths = [
      min(plan.rank + config.oversample, plan.short) if plan.projected else 0
      for plan in plans
  ]
  q0 = [
      _pad(p, k, 2) if plan.projected else None
      for plan, p, k in zip(plans, old_projectors, widths)
  ]
  small0 = [
      jnp.zeros((plan.batch, k, plan.short), jnp.float32)
      if plan.projected
      else None
      for plan, k in zip(plans, widths)
  ]
  value_shape, dense_shape, _ = jax.eval_shape(passes.long, q0)
  n_refresh = 2 * (config.power_iters + 1)
  body = _RangeFinderBody(passes, widths, window, refresh, n_refresh, refuse)
  _, _, q, small, refused, value, dense = jax.lax.while_loop(
      lambda carry: carry[0] < carry[1],
      body,
      (
          jnp.zeros([], jnp.int32),
          jnp.where(refresh, n_refresh, 1),
          q0,
          small0,
          jnp.zeros([], jnp.int32),
          jax.tree.map(jnp.zeros_like, value_shape),
          jax.tree.map(jnp.zeros_like, dense_shape),
      ),
  )
  projectors = [
      None if not plan.projected else q_BxLxK[:, :, : plan.rank]
      for plan, q_BxLxK in zip(plans, q)
  ]
  sketches = [
      None if not plan.projected else small_BxKxS[:, : plan.rank]
      for plan, small_BxKxS in zip(plans, small)
  ]
  return value, dense, sketches, projectors, refused


def _pad(x, k, axis):
  """``x`` zero-padded to ``k`` along ``axis``."""
  pad_widths = [(0, 0)] * x.ndim
  pad_widths[axis] = (0, k - x.shape[axis])
  return jnp.pad(x, pad_widths)


class _RangeFinderBody:
  """The ``lax.while_loop`` body of :func:`range_steps`: one long or short
  pass, and after the last refresh pass the rotation to the top singular
  directions.

  The carry is ``(i, n_passes, q, small, refused, value, dense)``.
  """

  def __init__(self, passes, widths, window, refresh, n_refresh, refuse):
    self.passes, self.widths, self.refuse = passes, widths, refuse
    self.window, self.refresh, self.n_refresh = window, refresh, n_refresh
    self.plans = passes.spec.plans
    self.config = passes.spec.config

  def _first_omega(self, plan: LeafPlan, k):
    key = proj_lib.window_key(self.config.seed, plan.index, self.window)
    return jax.random.normal(key, (plan.batch, plan.short, k), jnp.float32)

  def _short_pass(self, i, small):
    qr = proj_lib.orthonormal_columns
    omegas = [
        None
        if not plan.projected
        else jax.lax.cond(
            i == 0,
            lambda plan=plan, k=k: self._first_omega(plan, k),
            lambda s=s: qr(jnp.swapaxes(s, 1, 2)),
        )
        for plan, k, s in zip(self.plans, self.widths, small)
    ]
    value, dense, products = self.passes.short(omegas)
    return value, dense, [None if y is None else qr(y) for y in products], small

  def _long_pass(self, q):
    value, dense, products = self.passes.long(q)
    return value, dense, q, products

  def _rotate(self, q, small):
    """``P = Q U`` and ``U^T Q^T Gl`` with ``U`` the top left singular vectors
    of ``Q^T Gl``, padded to the width; refused projectors replaced."""
    projectors, sketches = [], []
    for plan, q_BxLxK, small_BxKxS in zip(self.plans, q, small):
      if not plan.projected:
        projectors.append(None)
        sketches.append(None)
        continue
      u_BxKxK, _, _ = proj_lib.thin_svd(small_BxKxS)
      u_BxKxR = u_BxKxK[:, :, : plan.rank]
      projectors.append(q_BxLxK @ u_BxKxR)
      sketches.append(jnp.swapaxes(u_BxKxR, 1, 2) @ small_BxKxS)
    projectors, refused = self.refuse(projectors)
    return (
        [
            None if p is None else _pad(p, k, 2)
            for p, k in zip(projectors, self.widths)
        ],
        [
            None if x is None else _pad(x, k, 1)
            for x, k in zip(sketches, self.widths)
        ],
        refused,
    )

  def __call__(self, carry):
    i, n_passes, q, small, refused, _, _ = carry
    n_refresh, refresh = self.n_refresh, self.refresh
    value, dense, q, small = jax.lax.cond(
        refresh & (i % 2 == 0) & (i < n_refresh),
        lambda: self._short_pass(i, small),
        lambda: self._long_pass(q),
    )
    q, small, new_refused = jax.lax.cond(
        refresh & (i == n_refresh - 1),
        lambda: self._rotate(q, small),
        lambda: (q, small, jnp.zeros([], jnp.int32)),
    )
    n_passes = n_passes + (new_refused > 0).astype(jnp.int32)
    return i + 1, n_passes, q, small, refused + new_refused, value, dense
