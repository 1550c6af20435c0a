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

from logra_jax.lowrank import LowRankDelta
from logra_jax.optim import factored as factored_lib
from logra_jax.optim import projection
from logra_jax.optim import state_queries
from logra_jax.optim.types import ProjectionSpec
from logra_jax.optim.types import ProjectState
from logra_jax.optim.types import SketchProjectors
from logra_jax.optim.sketch_passes import Passes
from logra_jax.optim.sketch_passes import range_steps


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

  reads this step's projectors from the ``scale_by_low_rank`` state inside
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
      ``"sketch_long"`` on their large axis, so that under a mesh they are
      split over the data axes (where those divide it) instead of replicated
      on every device.

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

  value_and_grad = value_and_grad_sum if micro_batched else jax.value_and_grad

  def fn(params, opt_state, *args):
    state = _project_state(opt_state)
    spec = state.spec
    plans = spec.plans
    params_flat = _check_params(spec, params)
    old_projectors = spec.treedef.flatten_up_to(state.projectors)
    _check_projector_shapes(plans, old_projectors)
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
    passes = Passes(
        loss_fn,
        has_aux,
        value_and_grad,
        spec,
        params_flat,
        args,
        constrain or (lambda x, _: x),
    )
    value, dense, sketches, projectors, refused = _sketch(
        passes, state, old_projectors
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


def _check_projector_shapes(plans, projectors) -> None:
  """Refuses stored projectors of another rank than their plans."""
  for plan, p in zip(plans, projectors):
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


def _refuser(state: ProjectState, old_projectors: list) -> Callable:
  """``refuse(projectors)``: refreshed projectors with non-finite matrices
  replaced, and the number replaced."""
  plans, config = state.spec.plans, state.spec.config

  def refuse(projectors):
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

  return refuse


def _sketch(passes: Passes, state: ProjectState, old_projectors: list):
  """``(value, dense, sketches, projectors, refused)`` of this step, by the
  projector kind."""
  plans, config = state.spec.plans, state.spec.config
  window = state.count // config.refresh_every
  refresh = state.count % config.refresh_every == 0
  refuse = _refuser(state, old_projectors)
  no_refusal = jnp.zeros([], jnp.int32)
  if config.kind == "random":
    projectors = [
        projection.random_window_projector(plan, config, window)
        if plan.projected
        else None
        for plan in plans
    ]
    return (*passes.long(projectors), projectors, no_refusal)
  if config.kind == "svd":
    return jax.lax.cond(
        refresh,
        lambda: passes.dense_svd(refuse),
        lambda: (*passes.long(old_projectors), old_projectors, no_refusal),
    )
  return range_steps(passes, old_projectors, window, refresh, refuse)


def project_state(opt_state) -> ProjectState | None:
  """The state of the one ``scale_by_low_rank`` stage in ``opt_state``, or None.

  Raises:
    ValueError: if there is more than one.
  """
  found = state_queries.find_states(opt_state, ProjectState)
  if len(found) > 1:
    raise ValueError(
        "sketch-direct gradients need at most one logra.scale_by_low_rank "
        f"stage in the optimizer state; found {len(found)}"
    )
  return found[0] if found else None


def _project_state(opt_state) -> ProjectState:
  state = project_state(opt_state)
  if state is None:
    raise ValueError(
        "value_and_sketch_grad needs an optimizer state with a "
        "logra.scale_by_low_rank stage (e.g. from logra.logra); found none"
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
