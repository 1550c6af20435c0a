"""The one-call LoGRA optimizer."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import optax

from logra_jax.optim import factored as factored_lib
from logra_jax.optim import kl_control
from logra_jax.optim import low_rank_space
from logra_jax.optim import step_codes
from logra_jax.optim.dimension_numbers import SpecTree


def _check_hyperparameters(**values: Any) -> None:
  """Raises a one-line ValueError naming the first of :func:`logra`'s
  scalar hyperparameters out of range: ``b1``, ``b2`` in ``[0, 1)``,
  ``eps``, ``weight_decay`` finite and ``>= 0``, ``learning_rate`` finite
  (a schedule, or an array, is left to optax)."""
  for name, value in values.items():
    if not isinstance(value, numbers.Real):
      continue
    if name in ("b1", "b2"):
      bad = not 0 <= value < 1
      wanted = "in [0, 1)"
    elif name == "learning_rate":
      bad = not math.isfinite(value)
      wanted = "a finite number"
    else:
      bad = not (math.isfinite(value) and value >= 0)
      wanted = "a finite number >= 0"
    if bad:
      raise ValueError(f"logra: {name} must be {wanted}, got {value}")


def logra(
    learning_rate: optax.ScalarOrSchedule,
    rank: int,
    kind: str = "range",
    refresh_every: int = 200,
    power_iters: int = 1,
    oversample: int = 8,
    seed: int = 0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    scale: float = 1.0,
    moment_policy: str = "transfer",
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    dimension_numbers: Optional[SpecTree] = None,
    mask: Any = None,
    keep_factors: bool = False,
    target_kl: Optional[float] = None,
    kl_mode: str = "clamp",
    factored: bool = False,
    step_bits: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""LoGRA: Adam on low-rank gradient sketches, with decoupled weight decay.

  For each matrix weight with projector :math:`P` (see
  :func:`scale_by_low_rank`),

  .. math::
    S_t = P^\top G_t, \quad
    N_t = \mathrm{Adam}(S_t), \quad
    W_{t+1} = W_t - \eta_t \big(\alpha P N_t + \lambda W_t\big),

  with Adam's moments held at the sketch shape (``O(r \min(m, n))``) and moved
  into the new basis at each refresh (``moment_policy``). Vectors and any leaf
  excluded by ``mask``/``dimension_numbers`` get plain AdamW. Weight decay is
  applied in full parameter space. With ``target_kl``, the final step
  (learning rate and weight decay included) goes through
  :func:`scale_by_predicted_kl`, and ``update`` takes a ``kl_predictor``.

  Args:
    learning_rate: :math:`\eta`, a float or an optax schedule.
    rank: projection rank ``r``.
    kind: projector kind, ``"range"``, ``"random"`` or ``"svd"``.
    refresh_every: steps between projector refreshes.
    power_iters: power iterations of the ``"range"`` projector.
    oversample: oversampling of the ``"range"`` projector.
    seed: seed of the random test matrices and projectors.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    scale: :math:`\alpha`, multiplies the unprojected low-rank updates.
    moment_policy: ``"transfer"``, ``"keep"`` or ``"reset"``.
    weight_decay: :math:`\lambda`.
    weight_decay_mask: pytree of bools (or callable) selecting decayed leaves.
    dimension_numbers: which axes form each matrix; see
      :func:`scale_by_low_rank`.
    mask: pytree of bools (or callable); False keeps a leaf dense.
    keep_factors: keep the factored updates in the state (see
      :func:`scale_by_low_rank`).
    target_kl: if set, the predicted-KL target of each step (see
      :func:`scale_by_predicted_kl`); None disables KL control.
    kl_mode: ``"clamp"`` or ``"target"``, with ``target_kl``.
    factored: updates of projected leaves stay factored
      (:class:`~logra_jax.optim.types.FactoredDelta`, weight decay
      included), for params kept as ``B + P A``
      (:mod:`logra_jax.optim.factored`); apply them with
      :func:`logra_jax.optim.factored.apply_updates`.
    step_bits: with ``factored``, round each final step to 4- or 8-bit codes
      with a power-of-two scale per row and error feedback
      (:func:`~logra_jax.optim.step_codes.quantize_steps`), so that a sync
      message carries the step in ``step_bits`` bits per coordinate and the
      learner applies exactly what it sends; needs ``weight_decay=0``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: ``b1`` or ``b2`` outside ``[0, 1)``, a non-finite
      ``learning_rate``, a negative or non-finite ``eps`` or
      ``weight_decay``, ``step_bits`` without ``factored`` or with weight
      decay (one line naming it).

  Example:
    >>> import jax, jax.numpy as jnp, optax, logra_jax as logra
    >>> params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    >>> loss = lambda p: jnp.sum((p["w"] @ jnp.ones(32) - 1.0) ** 2)
    >>> tx = logra.logra(learning_rate=1e-2, rank=4)
    >>> state = tx.init(params)
    >>> grads = jax.grad(loss)(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> bool(loss(params) < 64 * 31.0 ** 2)
    True

  References:
    Zhao et al., `GaLore <https://arxiv.org/abs/2403.03507>`_, 2024;
    Robert et al., `LDAdam <https://arxiv.org/abs/2410.16103>`_, 2024.
  """
  _check_hyperparameters(
      learning_rate=learning_rate,
      b1=b1,
      b2=b2,
      eps=eps,
      weight_decay=weight_decay,
  )
  kl = (
      []
      if target_kl is None
      else [kl_control.scale_by_predicted_kl(target_kl, mode=kl_mode)]
  )
  decay = []
  if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
    stage = factored_lib.add_decayed_weights(weight_decay)
    decay = [
        stage
        if weight_decay_mask is None
        else optax.masked(stage, weight_decay_mask)
    ]
  quantize = []
  if step_bits is not None:
    if not factored or decay:
      raise ValueError(
          "logra: step_bits needs factored=True and weight_decay=0 (a "
          "receiver adds the codes to its coordinates), got "
          f"factored={factored}, weight_decay={weight_decay}"
      )
    quantize = [
        step_codes.quantize_steps(
            step_bits,
            rank=rank,
            refresh_every=refresh_every,
            dimension_numbers=dimension_numbers,
            mask=mask,
        )
    ]
  return optax.chain(
      low_rank_space.scale_by_low_rank(
          optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
          rank=rank,
          kind=kind,
          refresh_every=refresh_every,
          power_iters=power_iters,
          oversample=oversample,
          seed=seed,
          dimension_numbers=dimension_numbers,
          mask=mask,
          moment_policy=moment_policy,
          betas=(b1, b2),
          scale=scale,
          keep_factors=keep_factors,
          factored=factored,
      ),
      *decay,
      optax.scale_by_learning_rate(learning_rate),
      *kl,
      *quantize,
  )
