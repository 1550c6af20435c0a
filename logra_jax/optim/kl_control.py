r"""Predicted-KL step control: predict how far an update moves the policy.

For a categorical policy with logits :math:`z_t(\theta)` at token position
:math:`t`, a step :math:`D` changes the logits to first order by
:math:`u_t = J_t D` (one ``jax.jvp``), and

.. math::
  \mathrm{KL}(\pi_\theta \,\|\, \pi_{\theta + sD}) \approx
  \tfrac{s^2}{2} D^\top F D, \qquad
  \tfrac12 D^\top F D = \kappa = \tfrac12 \operatorname{mean}_t
  \operatorname{Var}_{y \sim p_t}(u_{ty}),

with the variance summed exactly over the vocabulary. :func:`make_kl_predictor`
builds :math:`D \mapsto \kappa` for one batch; :func:`scale_by_predicted_kl`
scales each update so that its predicted KL meets a target.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from logra_jax.lowrank import LowRankDelta
from logra_jax.lowrank import matmul
from logra_jax.optim import factored as factored_lib
from logra_jax.optim.state_queries import find_states
from logra_jax.optim.types import FactoredDelta
from logra_jax.optim.types import FactoredUpdate

KL_MODES = ("clamp", "target")


def _factored_tangent(
    delta: FactoredDelta, weight: factored_lib.FactoredWeight
) -> Any:
  r"""The tangent of ``(B, A, c)`` that moves ``W = c B + P A`` by
  ``D = a W + P Delta``: ``(0, a A + Delta, a c)``."""
  decay = 0.0 if delta.decay is None else delta.decay
  return dataclasses.replace(
      weight,
      base=jnp.zeros_like(weight.base),
      coords=decay * weight.coords + delta.coords,
      scale=None if weight.scale is None else decay * weight.scale,
  )


def _project(h_BxCxD: jax.Array, w_DxV: Any) -> jax.Array:
  """``h @ w`` accumulated in float32 (:func:`~logra_jax.lowrank.matmul`:
  a factored ``w``, ``c B + P A``, is applied as ``c (h B) + (h P) A``,
  never formed)."""
  return matmul(h_BxCxD, w_DxV, preferred_element_type=jnp.float32)


def _densify(update: Any, params: Any) -> Any:
  """A tangent with the params' structure and dtypes: dense, or in the
  coordinates of factored params for :class:`FactoredDelta` updates."""

  def leaf(u, p):
    if isinstance(u, FactoredUpdate):
      u = u.dense()
    elif isinstance(u, FactoredDelta):
      if not factored_lib.is_factored(p):
        raise ValueError(
            f"a factored update of parameter {u.plan.path!r} needs factored "
            "params (logra_jax.optim.factored.factor) in the KL predictor"
        )
      u = _factored_tangent(u, p)
    return jax.tree.map(lambda t, q: jnp.asarray(t).astype(q.dtype), u, p)

  flat_p, treedef = jax.tree.flatten(params, is_leaf=factored_lib.is_factored)
  try:
    flat_u = treedef.flatten_up_to(update)
  except (ValueError, TypeError):
    raise ValueError(
        "the update given to the KL predictor does not match the structure of "
        f"the params it was built with: {jax.tree.structure(update)} vs "
        f"{jax.tree.structure(params)}"
    ) from None
  return treedef.unflatten([leaf(u, p) for u, p in zip(flat_u, flat_p)])


def _subsampled(
    batch: Any, token_mask: Optional[jax.Array], subsample: Optional[int]
) -> tuple[Any, Optional[jax.Array]]:
  """``subsample`` evenly spaced rows of the batch and of its token mask
  (all rows when None), checked against the batch size."""
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("make_kl_predictor needs a batch with at least one array")
  num_rows = jnp.shape(leaves[0])[0]
  if subsample is None:
    return batch, token_mask
  if not 1 <= subsample <= num_rows:
    raise ValueError(
        f"subsample must be in [1, {num_rows}] (the batch "
        f"size), got {subsample}"
    )
  rows = jnp.arange(subsample) * (num_rows // subsample)
  return (
      _rows(batch, rows),
      None if token_mask is None else _rows(token_mask, rows),
  )


def _float32_coords(params: Any) -> Any:
  """``params`` with the coordinates of factored weights in float32, so that
  a step's tangent in them is not rounded to bfloat16 coordinates' dtype
  (the values are the same: bfloat16 is a subset of float32)."""
  return jax.tree.map(
      lambda p: (
          dataclasses.replace(p, coords=p.coords.astype(jnp.float32))
          if factored_lib.is_factored(p)
          else p
      ),
      params,
      is_leaf=factored_lib.is_factored,
  )


def _token_variance(logits_CxV: jax.Array, tangent_CxV: jax.Array) -> jax.Array:
  """``Var_{y ~ softmax(logits)}(tangent_y)`` per row, in float32."""
  logits_CxV = logits_CxV.astype(jnp.float32)
  tangent_CxV = tangent_CxV.astype(jnp.float32)
  p_CxV = jax.nn.softmax(logits_CxV, axis=-1)
  mean_C = jnp.sum(p_CxV * tangent_CxV, axis=-1, keepdims=True)
  return jnp.sum(p_CxV * jnp.square(tangent_CxV - mean_C), axis=-1)


def _rows(tree: Any, rows: jax.Array) -> Any:
  return jax.tree.map(lambda x: jnp.take(jnp.asarray(x), rows, axis=0), tree)


class KLPredictor:
  r"""Maps an update :math:`D` to :math:`\kappa`, its predicted KL on a batch.

  Built by :func:`make_kl_predictor`. Calling it returns the scalar
  :math:`\kappa(D) = \tfrac12\,\mathrm{mean}_t \mathrm{Var}_{p_t}(J_t D)`
  over the masked tokens (NaN when the mask holds no token);
  :meth:`token_kl` returns the per-token terms.

  Attributes:
    token_mask: ``[B, T]`` float32 weights of the tokens the mean runs over.
  """

  def __init__(self, token_fn: Callable[[Any], jax.Array], token_mask):
    self._token_fn = token_fn
    self.token_mask = token_mask

  def token_kl(self, update: Any) -> jax.Array:
    r"""Per-token predicted KL :math:`\tfrac12\mathrm{Var}_{p_t}(J_t D)`,
    ``[B, T]`` float32, zero where the mask is zero."""
    return self._token_fn(update) * (self.token_mask > 0)

  def __call__(self, update: Any) -> jax.Array:
    tokens = jnp.sum(self.token_mask)
    total = jnp.sum(self.token_kl(update) * self.token_mask)
    return jnp.where(
        tokens > 0, total / jnp.where(tokens > 0, tokens, 1.0), jnp.nan
    )


def make_kl_predictor(
    logits_fn: Callable[[Any, Any], Any],
    params: Any,
    batch: Any,
    token_mask: Optional[jax.Array] = None,
    subsample: Optional[int] = None,
    chunk_size: int = 128,
    frozen_unembedding: bool = False,
) -> KLPredictor:
  r"""Builds the predicted-KL function of updates for one batch.

  For an update :math:`D` (the step that ``optax.apply_updates`` would add),

  .. math::
    \kappa(D) = \tfrac12 \operatorname{mean}_{t \in \mathrm{mask}}
      \Big[\sum_y p_{ty} u_{ty}^2 - \big(\sum_y p_{ty} u_{ty}\big)^2\Big],
    \qquad u_t = J_t D,

  the second-order (Fisher) approximation of
  :math:`\mathrm{KL}(\pi_\theta \| \pi_{\theta + D})`, exact over the
  vocabulary. The logit tangents :math:`u_t` come from one ``jax.jvp``; no
  Jacobian or Fisher matrix is formed.

  ``logits_fn(params, batch)`` returns either the logits ``[B, T, V]`` or a
  pair ``(hidden [B, T, D], unembedding [D, V])`` whose product is the logits.
  With the pair, the vocabulary projection and the sum over the vocabulary run
  over chunks of ``chunk_size`` positions (under ``lax.map``), so float32
  ``[B, T, V]`` logits and tangents are never held at once.

  Build the predictor inside the jitted step, from the batch the gradient
  came from, and pass it to the optimizer as ``kl_predictor``.

  Args:
    logits_fn: ``(params, batch) -> logits`` or ``-> (hidden, unembedding)``,
      differentiable in ``params``; include any sampling temperature.
    params: the current parameters :math:`\theta`.
    batch: a pytree of arrays with a leading batch axis, passed to
      ``logits_fn``.
    token_mask: ``[B, T]`` weights (e.g. the completion mask); default all
      ones.
    subsample: if set, predict on this many rows of the batch (evenly
      strided, so every GRPO group is represented), cutting the cost.
    chunk_size: positions per vocabulary chunk in the pair form.
    frozen_unembedding: in the pair form, the unembedding does not move with
      ``params`` (e.g. a frozen LM head under LoRA): its tangent term
      ``hidden @ d_unembedding`` is left out (one ``[B, T, V]`` product less
      per chunk, and no product with a constant zero, which XLA:CPU has
      been seen to compile, fused with the softmax, to NaN).

  Returns:
    A :class:`KLPredictor`: call it on an update (a pytree like ``params``;
    leaves may be arrays or :class:`FactoredUpdate`) to get the scalar
    :math:`\kappa`.

  Example:
    >>> import jax, jax.numpy as jnp, logra_jax as logra
    >>> params = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> batch = jax.random.normal(jax.random.key(1), (4, 3, 8))
    >>> logits_fn = lambda p, x: x @ p["w"]
    >>> predict = logra.make_kl_predictor(logits_fn, params, batch)
    >>> shift = {"w": 1e-3 * jnp.ones((8, 16))}   # moves all logits equally
    >>> bool(predict(shift) < 1e-12)
    True
    >>> step = {"w": 1e-3 * jax.random.normal(jax.random.key(2), (8, 16))}
    >>> double = {"w": 2 * step["w"]}
    >>> round(float(predict(double) / predict(step)), 3)   # quadratic in D
    4.0

  References:
    Schulman et al., `TRPO <https://arxiv.org/abs/1502.05477>`_, 2015
    (the Fisher form of the KL); Martens, `New insights and perspectives on
    the natural gradient method <https://arxiv.org/abs/1412.1193>`_, 2020.
  """
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  batch, token_mask = _subsampled(batch, token_mask, subsample)
  params = _float32_coords(params)

  def token_kl(update):
    tangent = _densify(update, params)
    primal_out, tangent_out = jax.jvp(
        lambda p: logits_fn(p, batch), (params,), (tangent,)
    )
    if isinstance(primal_out, (tuple, list)):
      hidden_BxTxD, w_DxV = primal_out
      d_hidden_BxTxD, d_w_DxV = tangent_out
      B, T, D = hidden_BxTxD.shape
      C = min(chunk_size, T)
      n = -(-T // C)

      def to_chunks(x_BxTxD):
        x_BxTxD = jnp.pad(x_BxTxD, ((0, 0), (0, n * C - T), (0, 0)))
        return x_BxTxD.reshape(B, n, C, D).swapaxes(0, 1)

      def head_term(h_BxCxD):
        """``h dW``. A factored head's tangent is taken through
        ``logits_fn`` here, inside the chunk, where the parts of ``W`` that
        do not move (its base, a fixed projector ``P``) have no tangent at
        all; outside ``jax.jvp`` they would be zero arrays, and ``h dW``
        would need ``dW`` formed ``[D, V]``. (The forward pass traced with
        it is unused and dropped.)"""
        if not isinstance(w_DxV, LowRankDelta):
          return _project(h_BxCxD, d_w_DxV)
        return jax.jvp(
            lambda p: _project(h_BxCxD, logits_fn(p, batch)[1]),
            (params,),
            (tangent,),
        )[1]

      @jax.checkpoint
      def chunk(args):
        h_BxCxD, dh_BxCxD = args
        logits_BxCxV = _project(h_BxCxD, w_DxV)
        d_logits_BxCxV = _project(dh_BxCxD, w_DxV)
        if not frozen_unembedding:
          d_logits_BxCxV += head_term(h_BxCxD)
        return _token_variance(logits_BxCxV, d_logits_BxCxV)

      var_nxBxC = jax.lax.map(
          chunk, (to_chunks(hidden_BxTxD), to_chunks(d_hidden_BxTxD))
      )
      var_BxT = var_nxBxC.swapaxes(0, 1).reshape(B, n * C)[:, :T]
    else:
      var_BxT = _token_variance(primal_out, tangent_out)
    return 0.5 * var_BxT

  mask_shape = jax.eval_shape(
      lambda: token_kl(jax.tree.map(jnp.zeros_like, params))
  ).shape
  if token_mask is None:
    token_mask = jnp.ones(mask_shape, jnp.float32)
  elif jnp.shape(token_mask) != mask_shape:
    raise ValueError(
        f"token_mask has shape {jnp.shape(token_mask)} but the "
        f"logits have token shape {mask_shape}"
    )
  token_mask = jnp.asarray(token_mask).astype(jnp.float32)
  try:
    empty = not bool(token_mask.any())
  except jax.errors.ConcretizationTypeError:  # traced: a NaN prediction skips
    empty = False
  if empty:
    raise ValueError(
        "make_kl_predictor: token_mask selects no token, so "
        "there is no KL to predict"
    )
  return KLPredictor(token_kl, token_mask)


class ScaleByPredictedKLState(NamedTuple):
  """State of :func:`scale_by_predicted_kl`.

  Attributes:
    count: updates seen.
    predicted_kl: predicted KL of the last *incoming* update (before scaling).
    scale: scale applied to the last update (0 for a skipped step).
    scaled_steps: number of updates whose scale was not 1.
    skipped_steps: number of updates dropped because the prediction was NaN,
      infinite or negative.
  """

  count: jax.Array
  predicted_kl: jax.Array
  scale: jax.Array
  scaled_steps: jax.Array
  skipped_steps: jax.Array


def kl_scale(
    predicted_kl: jax.Array,
    target_kl: float,
    min_scale: float,
    max_scale: float,
) -> jax.Array:
  r"""``clip(sqrt(target_kl / predicted_kl), min_scale, max_scale)``; ``max_scale``
  where the prediction is 0."""
  ratio = target_kl / jnp.maximum(predicted_kl, jnp.finfo(jnp.float32).tiny)
  return jnp.where(
      predicted_kl > 0,
      jnp.clip(jnp.sqrt(ratio), min_scale, max_scale),
      max_scale,
  ).astype(jnp.float32)


def scale_by_predicted_kl(
    target_kl: float,
    mode: str = "clamp",
    min_scale: float = 0.0,
    max_scale: Optional[float] = None,
    token_quantile_cap: Optional[float] = None,
    quantile: float = 0.99,
) -> optax.GradientTransformationExtraArgs:
  r"""Scales each update so that its predicted KL meets ``target_kl``.

  With :math:`\kappa` the predicted KL of the incoming update :math:`D` (from
  the ``kl_predictor`` extra argument; KL is quadratic in the step, so
  :math:`sD` has predicted KL :math:`s^2\kappa`), the output is :math:`sD` with

  .. math::
    s = \mathrm{clip}\big(\sqrt{\tau / \kappa},\ s_{\min},\ s_{\max}\big),

  where ``mode="clamp"`` has :math:`s_{\max} = 1` (only shrink steps that
  would overshoot the target :math:`\tau`) and ``mode="target"`` moves every
  step to the target within :math:`[s_{\min}, s_{\max}]` (default
  :math:`s_{\max} = 10`). With ``token_quantile_cap`` :math:`c`, also
  :math:`s \le \sqrt{c / q}` where :math:`q` is the ``quantile`` of the
  per-token predicted KL, so no single token moves far.

  A NaN, infinite or negative prediction (e.g. a batch without tokens) skips
  the step: the update is zeroed and ``skipped_steps`` counts it. Without a
  predictor the transform is the identity and warns once.

  Place it *last* in a chain (after ``scale_by_learning_rate``), so that it
  predicts the step that will actually be applied.

  Args:
    target_kl: :math:`\tau > 0`, the KL per token a step may cause.
    mode: ``"clamp"`` or ``"target"``.
    min_scale: :math:`s_{\min} \ge 0`.
    max_scale: :math:`s_{\max}`; at most 1 in ``"clamp"`` mode.
    token_quantile_cap: optional cap :math:`c > 0` on the ``quantile`` of the
      per-token predicted KL.
    quantile: the quantile used with ``token_quantile_cap``, in (0, 1].

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``kl_predictor`` (from :func:`make_kl_predictor`).

  Example:
    >>> import jax, jax.numpy as jnp, optax, logra_jax as logra
    >>> params = {"w": jax.random.normal(jax.random.key(0), (8, 16))}
    >>> x = jax.random.normal(jax.random.key(1), (4, 3, 8))
    >>> predictor = logra.make_kl_predictor(lambda p, x: x @ p["w"], params, x)
    >>> tx = logra.scale_by_predicted_kl(target_kl=1e-4)
    >>> state = tx.init(params)
    >>> big_step = {"w": jax.random.normal(jax.random.key(2), (8, 16))}
    >>> step, state = tx.update(big_step, state, params, kl_predictor=predictor)
    >>> round(float(predictor(step)) / 1e-4, 4)
    1.0

  References:
    Schulman et al., `TRPO <https://arxiv.org/abs/1502.05477>`_, 2015.
  """
  if not isinstance(target_kl, (int, float)) or not target_kl > 0:
    raise ValueError(f"target_kl must be a number > 0, got {target_kl!r}")
  if mode not in KL_MODES:
    raise ValueError(f"mode must be one of {KL_MODES}, got {mode!r}")
  if max_scale is None:
    max_scale = 1.0 if mode == "clamp" else 10.0
  if mode == "clamp" and max_scale > 1.0:
    raise ValueError(
        f"mode='clamp' only shrinks steps, so max_scale must be "
        f"<= 1, got {max_scale}; use mode='target' to grow them"
    )
  if min_scale < 0:
    raise ValueError(f"min_scale must be >= 0, got {min_scale}")
  if min_scale > max_scale:
    raise ValueError(
        f"min_scale ({min_scale}) must be <= max_scale " f"({max_scale})"
    )
  if token_quantile_cap is not None and not token_quantile_cap > 0:
    raise ValueError(
        f"token_quantile_cap must be > 0, got {token_quantile_cap!r}"
    )
  if not 0 < quantile <= 1:
    raise ValueError(f"quantile must be in (0, 1], got {quantile}")
  warned = []

  def init_fn(params):
    del params
    # Distinct buffers, so that the state can be donated to a jitted step.
    return ScaleByPredictedKLState(
        count=jnp.zeros([], jnp.int32),
        predicted_kl=jnp.zeros([], jnp.float32),
        scale=jnp.ones([], jnp.float32),
        scaled_steps=jnp.zeros([], jnp.int32),
        skipped_steps=jnp.zeros([], jnp.int32),
    )

  def update_fn(
      updates, state, params=None, *, kl_predictor=None, **extra_args
  ):
    del params, extra_args
    if kl_predictor is None:
      if not warned:
        warnings.warn(
            "scale_by_predicted_kl got no kl_predictor; updates pass "
            "through unscaled",
            stacklevel=2,
        )
        warned.append(True)
      return updates, state._replace(
          count=optax.safe_increment(state.count),
          predicted_kl=jnp.full([], jnp.nan, jnp.float32),
          scale=jnp.ones([], jnp.float32),
      )
    predicted, quantile_scale = _predict(
        kl_predictor, updates, token_quantile_cap, quantile
    )
    valid = jnp.isfinite(predicted) & (predicted >= 0)
    scale = jnp.minimum(
        kl_scale(predicted, target_kl, min_scale, max_scale), quantile_scale
    )
    scale = jnp.where(valid, scale, 0.0).astype(jnp.float32)
    updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
    return updates, ScaleByPredictedKLState(
        count=optax.safe_increment(state.count),
        predicted_kl=predicted,
        scale=scale,
        scaled_steps=state.scaled_steps
        + (valid & (scale != 1)).astype(jnp.int32),
        skipped_steps=state.skipped_steps + (~valid).astype(jnp.int32),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _predict(kl_predictor, updates, token_quantile_cap, quantile):
  """The predicted KL of ``updates`` and the scale that caps its
  ``quantile`` token at ``token_quantile_cap`` (inf without a cap)."""
  if token_quantile_cap is None:
    return jnp.asarray(kl_predictor(updates), jnp.float32), jnp.inf
  if not hasattr(kl_predictor, "token_kl"):
    raise TypeError(
        "token_quantile_cap needs a predictor with per-token "
        "values (from make_kl_predictor)"
    )
  mask = kl_predictor.token_mask
  token_kl = kl_predictor.token_kl(updates)
  tokens = jnp.sum(mask)
  predicted = jnp.where(
      tokens > 0,
      jnp.sum(token_kl * mask) / jnp.where(tokens > 0, tokens, 1.0),
      jnp.nan,
  )
  top = jnp.nanquantile(jnp.where(mask > 0, token_kl, jnp.nan), quantile)
  return predicted, kl_scale(top, token_quantile_cap, 0.0, math.inf)


def predicted_kl_state(
    opt_state: optax.OptState,
) -> Optional[ScaleByPredictedKLState]:
  """The state of the ``scale_by_predicted_kl`` stage inside ``opt_state``,
  or None if the optimizer has none."""
  found = find_states(opt_state, ScaleByPredictedKLState)
  if len(found) > 1:
    raise ValueError(
        "the optimizer state holds more than one " "scale_by_predicted_kl stage"
    )
  return found[0] if found else None
