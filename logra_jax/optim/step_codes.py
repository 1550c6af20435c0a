r"""Step factors sent in a few bits: :func:`quantize_steps`.

A factored policy's step changes each projected weight by :math:`P \Delta_t`
(``Delta`` is ``[batch, rank, short]`` float32, :class:`FactoredDelta`). A
sync message that carries :math:`\Delta_t` in ``bits`` bits per number
instead of 32 is exact only if the learner, too, applies what it sends.
:func:`quantize_steps` makes each step so: per row ``i`` of
:math:`T = \Delta_t + R_{t-1}` (the step plus what earlier steps' rounding
left over), with :math:`q_{\max} = 2^{\mathrm{bits}-1} - 1`,

.. math::
  e_i = \Big\lceil \log_2 \frac{\max_j |T_{ij}|}{q_{\max}} \Big\rceil, \quad
  Q_{ij} = \mathrm{round}\big(T_{ij}\, 2^{-e_i}\big) \in [-q_{\max},
  q_{\max}], \quad
  \hat\Delta_{ij} = Q_{ij}\, 2^{e_i}, \quad
  R_t = T - \hat\Delta,

and the step becomes :math:`\hat\Delta_t` (error feedback: what rounding
takes from one step is added to the next, so the applied steps' sum differs
from the unrounded one by :math:`R_t`, at most half a quantum
:math:`2^{e_i - 1}` per number). That holds for rows of magnitudes between
about :math:`q_{\max} 2^{-126}` (1e-37: below it, where a backend flushes
subnormal numbers, a row rounds to zero) and :math:`2^{127}` (above it a row
may decode to infinity: a step ``skip_non_finite`` skips, and that row keeps
no residual). A power-of-two scale makes
:math:`\hat\Delta` exactly ``Q * 2**e`` in float32, so ``A + decode(Q, e)``
on any receiver is the learner's ``A + Delta_hat``, bit for bit. The codes
``Q`` (int8, or two 4-bit codes per uint8 byte) and exponents ``e`` (int8,
one per row) of the last step stay in the state (:func:`last_codes`) for the
sync message. At a projector refresh the residual is dropped (it is in the
old basis), at most one step's rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.dimension_numbers import plan_leaves
from logra_jax.optim.dimension_numbers import SpecTree
from logra_jax.optim.state_queries import find_states
from logra_jax.optim.types import FactoredDelta

STEP_BITS = (4, 8)
# Exponents are kept in int8 and stay within float32's normal range.
_MIN_EXPONENT, _MAX_EXPONENT = -126, 127


class QuantizeStepsState(NamedTuple):
  """State of :func:`quantize_steps`, one entry per parameter leaf in
  ``jax.tree.leaves`` order (None at leaves that are not projected).

  Attributes:
    count: updates made.
    residual: :math:`R`, ``[batch, rank, short]`` float32: rounding not yet
      applied.
    codes: the last step's ``Q``: int8 ``[batch, rank, short]`` (8 bits), or
      uint8 ``[batch, rank, ceil(short / 2)]`` holding two 4-bit codes.
    exponents: the last step's ``e``, int8 ``[batch, rank]``.
  """

  count: jax.Array
  residual: tuple
  codes: tuple
  exponents: tuple


def max_code(bits: int) -> int:
  """:math:`q_{\\max} = 2^{\\mathrm{bits}-1} - 1`: 7 for 4 bits, 127 for 8."""
  return 2 ** (bits - 1) - 1


def encode(
    t_BxRxS: jax.Array, bits: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(codes, exponents, decoded)`` of float32 rows ``t`` (module
  docstring); a row holding a non-finite number decodes to NaN.

  Example:
    >>> import jax.numpy as jnp
    >>> codes, exponents, decoded = encode(jnp.array([[[0.3, -1.0]]]), 8)
    >>> int(exponents[0, 0]), decoded.tolist()
    (-6, [[[0.296875, -1.0]]])
  """
  if bits not in STEP_BITS:
    raise ValueError(f"step codes have {STEP_BITS} bits, got {bits}")
  t_BxRxS = jnp.asarray(t_BxRxS, jnp.float32)
  top = max_code(bits)
  peak_BxR = jnp.max(jnp.abs(t_BxRxS), axis=-1)
  # frexp: peak / top = f * 2**k with f in [0.5, 1), so 2**k bounds it and
  # 2**(k - 1) does too when f is exactly 0.5.
  fraction, power = jnp.frexp(peak_BxR / top)
  exponent_BxR = jnp.clip(
      power - (fraction == 0.5), _MIN_EXPONENT, _MAX_EXPONENT
  ).astype(jnp.int8)
  exponent_BxR = jnp.where(peak_BxR > 0, exponent_BxR, 0).astype(jnp.int8)
  scaled = jnp.ldexp(t_BxRxS, -exponent_BxR.astype(jnp.int32)[..., None])
  q_BxRxS = jnp.clip(jnp.round(scaled), -top, top).astype(jnp.int8)
  decoded = jnp.where(
      jnp.isfinite(peak_BxR)[..., None],
      _decoded(q_BxRxS, exponent_BxR),
      jnp.nan,
  )
  codes = q_BxRxS if bits == 8 else pack_nibbles(q_BxRxS)
  return codes, exponent_BxR, decoded


def decode(codes: jax.Array, exponents: jax.Array, short: int) -> jax.Array:
  """``Q * 2**e`` as float32 ``[batch, rank, short]`` (exact): the step a
  receiver adds to its coordinates. ``codes`` are int8 (8 bits) or packed
  uint8 (4 bits, :func:`pack_nibbles`)."""
  codes = jnp.asarray(codes)
  if codes.dtype == jnp.uint8:
    codes = unpack_nibbles(codes, short)
  return _decoded(codes, jnp.asarray(exponents))


def _decoded(q_BxRxS: jax.Array, exponent_BxR: jax.Array) -> jax.Array:
  return jnp.ldexp(
      q_BxRxS.astype(jnp.float32), exponent_BxR.astype(jnp.int32)[..., None]
  )


def pack_nibbles(q: jax.Array) -> jax.Array:
  """4-bit two's-complement codes in ``[-8, 7]`` along the last axis packed
  two per uint8 (the first in the low nibble; an odd count gets a zero
  code appended).

  Example:
    >>> import jax.numpy as jnp
    >>> packed = pack_nibbles(jnp.array([-7, 3, 5], jnp.int8))
    >>> packed.tolist(), unpack_nibbles(packed, 3).tolist()
    ([57, 5], [-7, 3, 5])
  """
  q = jnp.asarray(q, jnp.int8)
  if q.shape[-1] % 2:
    q = jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, 1)])
  nibbles = q.astype(jnp.uint8) & 0xF
  return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array, count: int) -> jax.Array:
  """The first ``count`` int8 codes of :func:`pack_nibbles`'s bytes."""
  packed = jnp.asarray(packed, jnp.uint8)
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
  nibbles = pairs.reshape(packed.shape[:-1] + (-1,))[..., :count]
  return (nibbles.astype(jnp.int8) ^ 8) - 8


def code_shape(sketch_shape: tuple[int, ...], bits: int) -> tuple[int, ...]:
  """Shape of the codes of coordinates of ``sketch_shape``."""
  *rows, short = sketch_shape
  return (*rows, short if bits == 8 else (short + 1) // 2)


def quantize_steps(
    bits: int,
    *,
    rank: int,
    refresh_every: int,
    dimension_numbers: Optional[SpecTree] = None,
    mask: Any = None,
) -> optax.GradientTransformation:
  r"""Rounds every :class:`FactoredDelta` step to ``bits``-bit codes with a
  power-of-two scale per row, with error feedback (module docstring).

  Place it last in a chain whose updates are factored
  (``scale_by_low_rank(factored=True)``), after every stage that scales the
  step (learning rate, predicted-KL control): the step it returns must be
  the one applied. ``rank``, ``refresh_every``, ``dimension_numbers`` and
  ``mask`` are those of that ``scale_by_low_rank`` stage (they give each
  leaf's sketch shape and the refresh steps). Dense leaves pass unchanged.
  A decayed step (``FactoredDelta.decay``, from weight decay) is refused:
  a receiver would need the factor ``1 + a`` too.

  Args:
    bits: 4 or 8 (:data:`STEP_BITS`).
    rank, refresh_every, dimension_numbers, mask: see above.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`QuantizeStepsState`.

  Example:
    >>> import jax.numpy as jnp, optax, logra_jax as logra
    >>> params = {"w": jnp.ones((16, 8))}
    >>> tx = optax.chain(
    ...     logra.scale_by_low_rank(rank=2, refresh_every=10, factored=True),
    ...     optax.scale(-1e-2),
    ...     quantize_steps(4, rank=2, refresh_every=10))
    >>> updates, state = tx.update({"w": jnp.ones((16, 8))}, tx.init(params))
    >>> q = updates["w"].coords
    >>> bool(jnp.all(q == decode(*last_codes(state)[0], q.shape[-1])))
    True
  """
  if bits not in STEP_BITS:
    raise ValueError(
        f"quantize_steps: bits must be one of {STEP_BITS}, got {bits}"
    )

  def init_fn(params):
    plans = jax.tree.leaves(plan_leaves(params, rank, dimension_numbers, mask))
    zeros = lambda shape, dtype: jnp.zeros(shape, dtype)
    per_leaf = lambda make: tuple(
        make(plan) if plan.projected else None for plan in plans
    )
    return QuantizeStepsState(
        count=jnp.zeros([], jnp.int32),
        residual=per_leaf(lambda p: zeros(p.sketch_shape, jnp.float32)),
        codes=per_leaf(
            lambda p: zeros(
                code_shape(p.sketch_shape, bits),
                jnp.int8 if bits == 8 else jnp.uint8,
            )
        ),
        exponents=per_leaf(lambda p: zeros(p.sketch_shape[:2], jnp.int8)),
    )

  def update_fn(updates, state, params=None):
    del params
    is_delta = lambda x: isinstance(x, FactoredDelta)
    flat, treedef = jax.tree.flatten(updates, is_leaf=is_delta)
    if len(flat) != len(state.residual):
      raise ValueError(
          f"quantize_steps was initialized for {len(state.residual)} "
          f"parameter leaves, the updates have {len(flat)}"
      )
    refresh = state.count % refresh_every == 0
    new_flat, residual, codes, exponents = [], [], [], []
    for u, r, c, e in zip(flat, state.residual, state.codes, state.exponents):
      if not is_delta(u):
        new_flat.append(u)
        residual.append(r), codes.append(c), exponents.append(e)
        continue
      _check_delta(u, r)
      total = u.coords + jnp.where(refresh, 0.0, r)
      step_codes, step_exponents, decoded = encode(total, bits)
      new_flat.append(FactoredDelta(coords=decoded, decay=None, plan=u.plan))
      # A row that does not decode to finite numbers makes the step skipped
      # (skip_non_finite); it leaves no residual behind to stall the next.
      residual.append(jnp.where(jnp.isfinite(decoded), total - decoded, 0.0))
      codes.append(step_codes)
      exponents.append(step_exponents)
    return treedef.unflatten(new_flat), QuantizeStepsState(
        count=optax.safe_increment(state.count),
        residual=tuple(residual),
        codes=tuple(codes),
        exponents=tuple(exponents),
    )

  return optax.GradientTransformation(init_fn, update_fn)


def _check_delta(u: FactoredDelta, residual: Optional[jax.Array]) -> None:
  path = u.plan.path
  if u.decay is not None:
    raise ValueError(
        f"quantize_steps: the step of {path!r} decays the weight "
        "(weight decay); quantized steps need weight_decay=0"
    )
  if residual is None or residual.shape != u.coords.shape:
    raise ValueError(
        f"quantize_steps: {path!r} has a factored step of shape "
        f"{tuple(u.coords.shape)} but the stage was initialized for "
        f"{None if residual is None else tuple(residual.shape)}: give it the "
        "rank, dimension numbers and mask of the scale_by_low_rank stage"
    )


def quantize_state(opt_state: optax.OptState) -> Optional[QuantizeStepsState]:
  """The :class:`QuantizeStepsState` in ``opt_state``, or None."""
  found = find_states(opt_state, QuantizeStepsState)
  if len(found) > 1:
    raise ValueError(
        f"expected at most one quantize_steps stage, found {len(found)}"
    )
  return found[0] if found else None


def last_codes(opt_state: optax.OptState) -> list:
  """``(codes, exponents)`` of the last step per leaf (None at leaves that
  are not projected), in ``jax.tree.leaves`` order of the params, from the
  :func:`quantize_steps` stage of ``opt_state``."""
  state = quantize_state(opt_state)
  if state is None:
    raise ValueError("the optimizer state has no quantize_steps stage")
  return [
      None if c is None else (c, e)
      for c, e in zip(state.codes, state.exponents)
  ]
