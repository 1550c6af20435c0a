"""The non-finite guard: an optimizer wrapper that skips a non-finite update.

A step whose loss, gradients, predicted KL or update is not finite leaves the
parameters and the inner optimizer's state unchanged; the state counts the
skipped steps and says what was non-finite, so a run can stop with a clear
message after several in a row.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.kl_control import predicted_kl_state
from logra_jax.optim.state_queries import find_states

# What `SkipNonFiniteState.reason` bits stand for, lowest bit first.
NON_FINITE_REASONS = ("loss", "gradients", "predicted KL", "update")


class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_non_finite`.

  Attributes:
    count: updates seen, applied or skipped.
    inner_state: the wrapped optimizer's state (unchanged by a skipped update).
    skipped_steps: updates skipped so far.
    consecutive_skips: updates skipped in a row, ending with the last one (0
      when the last one was applied).
    reason: what was non-finite in the current run of skipped updates, as
      bits of :data:`NON_FINITE_REASONS` (1 loss, 2 gradients, 4 predicted
      KL, 8 update); 0 when the last update was applied.
  """

  count: jax.Array
  inner_state: optax.OptState
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  reason: jax.Array


def _all_finite(tree: Any) -> jax.Array:
  """True when every element of every leaf is finite (True for no leaves)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def skip_non_finite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Skips an update with a non-finite loss, gradient, predicted KL or result.

  The loss (the optional ``loss`` extra argument) and the gradients are
  checked before ``inner`` runs: if either is not finite, ``inner`` is
  skipped altogether (``lax.cond``), so the update is zero and its state
  stays as it was. A non-finite predicted KL (when a
  ``kl_predictor`` is given, as recorded by ``logra.scale_by_predicted_kl``,
  which then zeroes the step itself, though a later stage such as
  ``quantize_steps`` may still add its own) counts as a skip too: the
  skipped update's result is returned, with the state advanced as ``inner``
  left it. So does a non-finite result (reason
  ``"update"``: the update, or what ``apply_fn`` made of it, e.g. from a NaN
  or infinite learning rate or moments that overflowed): the result of a
  skipped update (zeros, or ``apply_fn`` of zeros: the old params) is
  returned instead, and the state is kept as ``inner`` advanced it. Each skip
  is counted in :class:`SkipNonFiniteState` (read it on the host with
  :func:`non_finite_state`). Like ``optax.apply_if_finite``, but it also
  looks at the loss, the predicted KL and the result, and reports why.

  Memory: the inputs are checked before the update, so no select between the
  new and the old state keeps a second copy of it (Adam's state is two
  copies of the params). The result can only be checked after it is
  computed, so the old values stay alive until all of it is known to be
  finite: one copy of the params and a byte per element (the result's
  finiteness) in temporaries, and under LoGRA less than
  ``optax.apply_if_finite`` (XLA's memory analysis of a donated step,
  float32 and bfloat16, ``tests/optim/test_non_finite.py``). The state is not
  restored for the same reason (if it went non-finite itself, the next
  updates are skipped too, for "update", until the trainer's limit of
  consecutive skips stops the run). Checking the update before applying it
  instead would hold every leaf's ``P N`` at once.

  The keyword argument ``apply_fn`` (taken here, not passed on) is applied to
  the update inside the guard, and ``update`` then returns its result in
  place of the update, e.g. ``apply_fn=lambda u: optax.apply_updates(params,
  u)`` returns new params; a skipped update reaches it as zeros. XLA can then
  apply each leaf's update as soon as it is computed instead of holding the
  update of every parameter at once (a low-rank update ``P N`` is as large as
  its parameter).

  Args:
    inner: the optimizer to guard (any optax transformation; extra arguments
      such as ``kl_predictor`` are passed on to it).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = skip_non_finite(optax.adam(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0])},
    ...                            state, params)
    >>> updates["w"].tolist(), int(state.skipped_steps)
    ([0.0, 0.0, 0.0], 1)
    >>> non_finite_reasons(state.reason)
    ['gradients']
    >>> tx = skip_non_finite(optax.sgd(float("inf")))
    >>> updates, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    >>> updates["w"].tolist(), non_finite_reasons(state.reason)
    ([0.0, 0.0, 0.0], ['update'])
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    zero = lambda: jnp.zeros([], jnp.int32)  # distinct buffers (donation)
    return SkipNonFiniteState(
        count=zero(),
        inner_state=inner.init(params),
        skipped_steps=zero(),
        consecutive_skips=zero(),
        reason=zero(),
    )

  def update_fn(
      updates, state, params=None, *, loss=None, apply_fn=None, **extra_args
  ):
    apply_fn = (lambda u: u) if apply_fn is None else apply_fn
    loss_ok = jnp.asarray(True) if loss is None else _all_finite(loss)
    grads_ok = _all_finite(updates)
    inputs_ok = loss_ok & grads_ok

    inner_update = lambda: inner.update(
        updates, state.inner_state, params, **extra_args
    )

    def run():
      new_updates, new_inner = inner_update()
      kl_ok = jnp.asarray(True)
      kl_state = (
          predicted_kl_state(new_inner)
          if extra_args.get("kl_predictor") is not None
          else None
      )
      if kl_state is not None:
        kl_ok = jnp.isfinite(kl_state.predicted_kl)
      out = apply_fn(new_updates)
      update_ok = _all_finite(out)
      skipped_out = apply_fn(jax.tree.map(jnp.zeros_like, new_updates))
      out = jax.tree.map(
          lambda new, old: jnp.where(update_ok & kl_ok, new, old),
          out,
          skipped_out,
      )
      return out, new_inner, kl_ok, update_ok

    def skip():
      zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(inner_update)[0])
      true = jnp.asarray(True)
      return apply_fn(zeros), state.inner_state, true, true

    # Decided from the inputs, before the update, with lax.cond: the state is
    # updated in place (a select between the new and the old state keeps a
    # second copy of the state alive).
    out, new_inner, kl_ok, update_ok = jax.lax.cond(inputs_ok, run, skip)
    checks = (loss_ok, grads_ok, kl_ok, update_ok)
    reason = sum(
        jnp.where(ok, 0, 1 << i).astype(jnp.int32)
        for i, ok in enumerate(checks)
    )
    ok = reason == 0
    skipped = (~ok).astype(jnp.int32)
    return out, SkipNonFiniteState(
        count=optax.safe_increment(state.count),
        inner_state=new_inner,
        skipped_steps=state.skipped_steps + skipped,
        consecutive_skips=jnp.where(ok, 0, state.consecutive_skips + 1),
        reason=jnp.where(ok, 0, state.reason | reason),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def non_finite_state(opt_state: optax.OptState) -> SkipNonFiniteState | None:
  """The :func:`skip_non_finite` state inside ``opt_state``, or None."""
  found = find_states(opt_state, SkipNonFiniteState)
  return found[0] if found else None


def non_finite_reasons(reason: int) -> list[str]:
  """The names of the bits set in :attr:`SkipNonFiniteState.reason`."""
  return [
      name for i, name in enumerate(NON_FINITE_REASONS) if int(reason) >> i & 1
  ]
