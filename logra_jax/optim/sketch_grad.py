r"""Sketch-direct gradients: LoGRA's sketch ``P^T G`` without a full gradient.

For a projected weight ``W`` (``m x n``, rows = input dimension) with this
step's projector ``P`` (``m x r`` when ``m >= n``), the loss is differentiated
with respect to zero coordinates ``Z`` of a low-rank perturbation instead of
``W`` itself:

.. math::
  W_{\mathrm{eff}} = \mathrm{sg}(W) + P Z,\quad Z = 0
  \;\Longrightarrow\;
  \frac{\partial L}{\partial Z} = P^\top G .

A linear layer applies it as ``x sg(W) + (x P) Z`` (:func:`matmul`), so the
backward pass computes ``(x P)^T dY`` directly: no ``m x n`` gradient exists,
not even for one layer, and micro-batch sums and data-parallel reductions act
on ``r x n`` sketches. Wide weights use ``W + Z P^T`` (``Z`` is ``m x r``).
An embedding lookup of a projected table goes through :func:`take`
(``W[ids] + P[ids] Z``), whose gradient is as thin.

The projector refresh needs no full gradient either: the randomized range
finder only multiplies the gradient by thin matrices, ``G Omega`` (the same
trick with ``W + Z Omega^T``) and ``Q^T G``, so a refresh step runs
``2 (power_iters + 1)`` backward passes instead of one (``kind="range"``);
``kind="random"`` needs nothing. ``kind="svd"`` needs the singular vectors of
the full gradient, so on refresh steps it falls back to one dense gradient
(and the compiled step's peak memory is that of the dense path).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from logra_jax import lowrank
from logra_jax.lowrank import LowRankDelta
from logra_jax.optim import factored as factored_lib
from logra_jax.optim import projectors as proj_lib
from logra_jax.optim import projection
from logra_jax.optim import state_queries
from logra_jax.optim.types import ProjectionSpec
from logra_jax.optim.types import ProjectState
from logra_jax.optim.types import SketchProjectors
from logra_jax.optim.dimension_numbers import LeafPlan


def _view_leaf(
    w: factored_lib.FactoredWeight, p_BxLxR: jax.Array
) -> LowRankDelta:
  """The :class:`LowRankDelta` ``c B + P A`` of one factored weight."""
  plan = w.plan
  layers = plan.shape[:-2]
  factor = p_BxLxR.reshape(layers + p_BxLxR.shape[-2:])
  coords = w.coords.reshape(layers + w.coords.shape[-2:])
  return LowRankDelta(
      w.base,
      factor,
      coords if plan.left else jnp.swapaxes(coords, -1, -2),
      rows=plan.left,
      path=plan.path,
      base_scale=None if w.scale is None else w.scale.reshape(layers),
  )


def factored_view(params: Any, projectors: Any) -> Any:
  r"""Factored params as the model consumes them.

  Each :class:`~logra_jax.optim.factored.FactoredWeight` becomes the
  :class:`LowRankDelta` :math:`c B + P A` (``B`` under ``stop_gradient``;
  differentiable in ``A`` and ``c``), which :func:`matmul` and :func:`take`
  apply as ``c (x B) + (x P) A`` without forming the ``m x n`` weight.

  Args:
    params: factored params (:func:`logra_jax.optim.factored.factor`).
    projectors: a tree like the params with each projected leaf's
      ``[batch, long, rank]`` projector: this step's (the
      :class:`~logra_jax.SketchProjectors` of :func:`value_and_sketch_grad`)
      or the last update's (``state_queries.window_projectors``).

  Returns:
    A tree like ``params`` with a ``LowRankDelta`` at each factored leaf.
  """
  flat, treedef = jax.tree.flatten(params, is_leaf=factored_lib.is_factored)
  flat_p = treedef.flatten_up_to(projectors)
  return treedef.unflatten(
      [
          _view_leaf(w, p) if factored_lib.is_factored(w) else w
          for w, p in zip(flat, flat_p)
      ]
  )


def value_and_grad_sum(
    loss_fn: Callable,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
) -> Callable:
  """``jax.value_and_grad`` summed over a leading micro-batch axis.

  The returned function takes the same arguments as ``loss_fn``; the
  arguments after the differentiated ones carry a leading axis of ``M``
  micro-batches. It runs ``lax.scan`` over them, so activations of only one
  micro-batch are alive at a time, and returns the values (and aux) stacked
  ``[M, ...]`` and the gradients summed: the gradient of the sum of the
  micro-batch losses.

  Example:
    >>> import jax.numpy as jnp
    >>> loss = lambda w, x: jnp.sum(w * x)
    >>> values, grad = value_and_grad_sum(loss)(2.0, jnp.arange(3.0))
    >>> values.tolist(), float(grad)
    ([0.0, 2.0, 4.0], 3.0)
  """
  argnums_tuple = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  grad_fn = jax.value_and_grad(loss_fn, argnums=argnums, has_aux=has_aux)
  n_diff = max(argnums_tuple) + 1

  def summed(*args):
    fixed, micro = args[:n_diff], args[n_diff:]

    def body(grad_sum, mb):
      value, grads = grad_fn(*fixed, *mb)
      return jax.tree.map(jnp.add, grad_sum, grads), value

    first = jax.tree.map(lambda x: x[0], micro)
    _, grads_shape = jax.eval_shape(grad_fn, *fixed, *first)
    zeros = jax.tree.map(jnp.zeros_like, grads_shape)
    grad_sum, values = jax.lax.scan(body, zeros, micro)
    return values, grad_sum

  return summed


def value_and_sketch_grad(
    loss_fn: Callable,
    *,
    has_aux: bool = False,
    micro_batched: bool = False,
    constrain: Callable | None = None,
) -> Callable:
  r"""Like ``jax.value_and_grad``, but returns LoGRA sketches of the gradients.

  ``loss_fn(params, *args)`` must take the parameters as its first argument
  and multiply every projected weight with :func:`matmul` (the decoder in
  :mod:`logra_jax.models` does). The returned function

  ``fn(params, opt_state, *args) -> (value, grads, projectors)``

  reads this step's projectors from the ``logra.project`` state inside
  ``opt_state`` (refreshing them on refresh steps, from thin products with
  the gradient), and gives ``grads`` with the sketch
  :math:`S = P^\top G` (``[batch, rank, short]``, float32) at projected
  leaves and the ordinary gradient elsewhere, plus ``projectors``, a
  :class:`~logra_jax.SketchProjectors` (``P`` per projected leaf, None
  elsewhere, and the count of refused projectors). Feed both to the
  optimizer:

  ``tx.update(grads, opt_state, params, projectors=projectors)``

  which then skips its own projection. ``params`` may be factored
  (:func:`logra_jax.optim.factored.factor`: every projected leaf a
  ``FactoredWeight``): the loss then sees :math:`W = c B + P A` through
  :func:`factored_view` with the last update's projectors, and the optimizer
  (``logra.logra(..., factored=True)``) returns updates of ``A``. The
  result equals projecting the dense gradient (to float rounding); see the
  module docstring for the cost of refresh steps per projector kind. A
  refreshed projector that is not finite is replaced as
  :func:`logra_jax.optim.projection.refuse_non_finite_projector` says before
  any sketch is taken with it (``kind="range"`` then runs one more backward
  pass), and counted in ``projectors.non_finite``.

  Args:
    loss_fn: ``loss_fn(params, *args) -> loss`` (or ``(loss, aux)``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    micro_batched: if True, every array in ``args`` has a leading axis of
      micro-batches; ``loss_fn`` sees one at a time (``lax.scan``), values and
      aux come back stacked ``[M, ...]`` and the gradients summed.
    constrain: optional ``constrain(x, logical_axes)`` (such as
      :func:`logra_jax.parallel.constrain`) applied to the thin factors and
      coordinates (``[*layers, long, k]`` and the like) with the logical name
      ``"batch"`` on their large axis, so that under a mesh they are split
      over the data axes instead of replicated on every device.

  Returns:
    ``fn(params, opt_state, *args) -> (value, grads, projectors)``, where
    ``value`` is ``(loss, aux)`` with ``has_aux``.

  Raises:
    ValueError: naming the leaf, if ``params`` do not match the parameters
      the optimizer state was initialized with, if the state's projectors
      have another rank than its plan, if a projected weight is not laid out
      ``[*layers, in, out]``, or if ``loss_fn`` never multiplied a projected
      weight through :func:`matmul` (e.g. it closes over the parameters
      instead of taking them).

  Example:
    >>> import jax, jax.numpy as jnp, optax, logra_jax as logra
    >>> from logra_jax.lowrank import matmul
    >>> params = {"w": jnp.ones((16, 8)) / 4}
    >>> x = jax.random.normal(jax.random.key(0), (32, 16))
    >>> loss = lambda p, x: jnp.mean(matmul(x, p["w"]) ** 2)
    >>> tx = logra.logra(learning_rate=1e-2, rank=2)
    >>> state = tx.init(params)
    >>> loss_value, grads, projectors = logra.value_and_sketch_grad(loss)(
    ...     params, state, x)
    >>> grads["w"].shape
    (1, 2, 8)
    >>> updates, state = tx.update(grads, state, params, projectors=projectors)
    >>> updates["w"].shape
    (16, 8)
  """

  def fn(params, opt_state, *args):
    state = _project_state(opt_state)
    spec = state.spec
    plans = spec.plans
    params_flat = _check_params(spec, params)
    old_projectors = spec.treedef.flatten_up_to(state.projectors)
    for plan, p in zip(plans, old_projectors):
      if (
          plan.projected
          and p is not None
          and tuple(p.shape) != plan.projector_shape
      ):
        raise ValueError(
            f"the optimizer state's projector for parameter {plan.path!r} has "
            f"shape {tuple(p.shape)} but its plan needs "
            f"{plan.projector_shape} (rank {plan.rank}): the state is stale, "
            "from another rank or model; re-initialize it"
        )
    config = spec.config
    window = state.count // config.refresh_every
    refresh = state.count % config.refresh_every == 0
    # Factored weights enter as c B + P A with the last update's projectors,
    # so the loss sees W whether or not the window was merged.
    params_flat = [
        _view_leaf(p, q) if factored_lib.is_factored(p) else p
        for p, q in zip(
            params_flat,
            spec.treedef.flatten_up_to(
                state_queries.window_projectors(opt_state)
            ),
        )
    ]
    passes = _Passes(
        loss_fn,
        has_aux,
        micro_batched,
        spec,
        params_flat,
        args,
        constrain or (lambda x, _: x),
    )

    def refuse(projectors):
      """Refreshed projectors with non-finite matrices replaced, and the
      number replaced."""
      pairs = [
          None
          if p is None
          else projection.refuse_non_finite_projector(
              p, p_old, plan, config, state.count
          )
          for plan, p, p_old in zip(plans, projectors, old_projectors)
      ]
      refused = sum(
          (pair[1] for pair in pairs if pair is not None),
          jnp.zeros([], jnp.int32),
      )
      return [None if pair is None else pair[0] for pair in pairs], refused

    no_refusal = jnp.zeros([], jnp.int32)
    if config.kind == "random":
      projectors = [
          projection.random_window_projector(plan, config, window)
          if plan.projected
          else None
          for plan in plans
      ]
      value, dense, sketches = passes.long(projectors)
      refused = no_refusal
    elif config.kind == "svd":
      value, dense, sketches, projectors, refused = jax.lax.cond(
          refresh,
          lambda: passes.dense_svd(refuse),
          lambda: (*passes.long(old_projectors), old_projectors, no_refusal),
      )
    else:
      value, dense, sketches, projectors, refused = _range_steps(
          passes, old_projectors, window, refresh, refuse
      )

    grads = [
        s if plan.projected else d for plan, s, d in zip(plans, sketches, dense)
    ]
    projectors = [
        p if plan.projected else None for plan, p in zip(plans, projectors)
    ]
    return (
        value,
        spec.treedef.unflatten(grads),
        SketchProjectors(spec.treedef.unflatten(projectors), refused),
    )

  return fn


def project_state(opt_state) -> ProjectState | None:
  """The state of the one ``logra.project`` stage in ``opt_state``, or None.

  Raises:
    ValueError: if there is more than one.
  """
  found = state_queries.find_states(opt_state, ProjectState)
  if len(found) > 1:
    raise ValueError(
        "sketch-direct gradients need at most one logra.project "
        f"stage in the optimizer state; found {len(found)}"
    )
  return found[0] if found else None


def _project_state(opt_state) -> ProjectState:
  state = project_state(opt_state)
  if state is None:
    raise ValueError(
        "value_and_sketch_grad needs an optimizer state with a "
        "logra.project stage (e.g. from logra.logra); found none"
    )
  return state


def _check_params(spec: ProjectionSpec, params) -> list:
  """Flattens ``params`` against the state's plans; errors name the leaf."""
  flat = projection.flatten_like(spec, params, "params")
  any_factored = any(map(factored_lib.is_factored, flat))
  for p, plan in zip(flat, spec.plans):
    if tuple(jnp.shape(p)) != plan.shape:
      raise ValueError(
          f"parameter {plan.path!r} has shape {tuple(jnp.shape(p))}, but the "
          f"optimizer state was initialized for shape {plan.shape}"
      )
    if plan.projected:
      factored_lib.check_layers_in_out(plan, "sketch-direct gradients")
    if factored_lib.is_factored(p) and (
        p.plan != plan or tuple(jnp.shape(p.coords)) != plan.sketch_shape
    ):
      raise ValueError(
          f"factored parameter {plan.path!r} was made for rank "
          f"{p.plan.rank} with coordinates of shape "
          f"{tuple(jnp.shape(p.coords))}, but the optimizer state projects "
          f"it at rank {plan.rank} ({plan.sketch_shape}); factor the weights "
          "with this optimizer state (logra_jax.optim.factored.factor)"
      )
    if factored_lib.is_factored(p) and not plan.projected:
      raise ValueError(
          f"parameter {plan.path!r} is factored but the "
          "optimizer state keeps it dense"
      )
    if any_factored and plan.projected and not factored_lib.is_factored(p):
      raise ValueError(
          f"parameter {plan.path!r} is dense but the optimizer state "
          "projects it; with factored weights every projected parameter "
          "must be factored"
      )
  return flat


class _Passes:
  """Backward passes that return thin products of every projected gradient.

  In terms of the long view ``Gl`` of a gradient (``[batch, long, short]``,
  ``G`` or ``G^T``): ``long(Q)`` returns ``Q^T Gl`` (``[batch, k, short]``,
  the sketch when ``Q = P``) and ``short(Omega)`` returns ``Gl Omega``
  (``[batch, long, k]``). Both also return the loss value and the ordinary
  gradients of the dense leaves.
  """

  def __init__(
      self, loss_fn, has_aux, micro_batched, spec, params_flat, args, constrain
  ):
    self.loss_fn, self.has_aux, self.constrain = loss_fn, has_aux, constrain
    self.micro_batched = micro_batched
    self.spec, self.params_flat, self.args = spec, params_flat, args

  def _grad(self, fn, diff):
    if self.micro_batched:
      return value_and_grad_sum(fn, has_aux=self.has_aux)(diff, *self.args)
    return jax.value_and_grad(fn, has_aux=self.has_aux)(diff, *self.args)

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
    axes[axis] = "batch"
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


def _range_steps(
    passes: _Passes, old_projectors: list, window, refresh, refuse: Callable
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
  spec = passes.spec
  config = spec.config
  plans = spec.plans
  widths = [
      min(plan.rank + config.oversample, plan.short) if plan.projected else 0
      for plan in plans
  ]
  qr = proj_lib.orthonormal_columns

  def first_omega(plan: LeafPlan, k):
    key = proj_lib.window_key(config.seed, plan.index, window)
    return jax.random.normal(key, (plan.batch, plan.short, k), jnp.float32)

  def pad(x, k, axis):
    pad_widths = [(0, 0)] * x.ndim
    pad_widths[axis] = (0, k - x.shape[axis])
    return jnp.pad(x, pad_widths)

  q0 = [
      pad(p, k, 2) if plan.projected else None
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
  no_refusal = jnp.zeros([], jnp.int32)

  def rotate(q, small):
    """``P = Q U`` and ``U^T Q^T Gl`` with ``U`` the top left singular vectors
    of ``Q^T Gl``, padded to the width; refused projectors replaced."""
    projectors, sketches = [], []
    for plan, q_BxLxK, small_BxKxS in zip(plans, q, small):
      if not plan.projected:
        projectors.append(None)
        sketches.append(None)
        continue
      u_BxKxK, _, _ = proj_lib.thin_svd(small_BxKxS)
      u_BxKxR = u_BxKxK[:, :, : plan.rank]
      projectors.append(q_BxLxK @ u_BxKxR)
      sketches.append(jnp.swapaxes(u_BxKxR, 1, 2) @ small_BxKxS)
    projectors, refused = refuse(projectors)
    return (
        [
            None if p is None else pad(p, k, 2)
            for p, k in zip(projectors, widths)
        ],
        [None if x is None else pad(x, k, 1) for x, k in zip(sketches, widths)],
        refused,
    )

  def body(carry):
    i, n_passes, q, small, refused, _, _ = carry

    def short_pass():
      omegas = [
          None
          if not plan.projected
          else jax.lax.cond(
              i == 0,
              lambda plan=plan, k=k: first_omega(plan, k),
              lambda s=s: qr(jnp.swapaxes(s, 1, 2)),
          )
          for plan, k, s in zip(plans, widths, small)
      ]
      value, dense, products = passes.short(omegas)
      return (
          value,
          dense,
          [None if y is None else qr(y) for y in products],
          small,
      )

    def long_pass():
      value, dense, products = passes.long(q)
      return value, dense, q, products

    value, dense, q, small = jax.lax.cond(
        refresh & (i % 2 == 0) & (i < n_refresh), short_pass, long_pass
    )
    q, small, new_refused = jax.lax.cond(
        refresh & (i == n_refresh - 1),
        lambda: rotate(q, small),
        lambda: (q, small, no_refusal),
    )
    n_passes = n_passes + (new_refused > 0).astype(jnp.int32)
    return i + 1, n_passes, q, small, refused + new_refused, value, dense

  _, _, q, small, refused, value, dense = jax.lax.while_loop(
      lambda carry: carry[0] < carry[1],
      body,
      (
          jnp.zeros([], jnp.int32),
          jnp.where(refresh, n_refresh, 1),
          q0,
          small0,
          no_refusal,
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
