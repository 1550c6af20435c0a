r"""LoRA, the low-rank adapter baseline: :math:`W = W_0 + s\,D U`.

Each targeted matrix ``[*layers, in, out]`` keeps its starting weight
:math:`W_0` frozen (in the base dtype) and learns a down projection ``D``
(``[*layers, in, r]``, float32, drawn uniformly from
:math:`\pm 1/\sqrt{in}` as PEFT's Kaiming init draws it) and an up
projection ``U`` (``[*layers, r, out]``, float32, zero, so training starts
at :math:`W_0`), scaled by :math:`s = \alpha / r`. Every other parameter
(embeddings, norms, biases, the LM head) is frozen. Models consume a
:class:`LoraWeight` through :func:`view` as the low-rank weight op of the
factored policy (:class:`logra_jax.lowrank.LowRankDelta`):

.. math:: y = x W_0 + \big((x\,s D)\,U\big),

so the backward pass computes :math:`\partial L / \partial U = (x s D)^\top
\delta` and :math:`\partial L / \partial D = s\,x^\top (\delta U^\top)` and
never an ``in x out`` gradient. The optimizer runs on :func:`trainable`
(the adapters alone); :func:`merge` gives the dense weights for export, the
rollout engine and evaluation.

Example:
  >>> import jax, jax.numpy as jnp
  >>> params = {"layers": {"q_proj": jnp.ones((2, 8, 4))}, "norm": jnp.ones(4)}
  >>> weights = add_adapters(params, rank=2, alpha=4.0, targets=("q_proj",))
  >>> w = weights["layers"]["q_proj"]
  >>> w.down.shape, w.up.shape, w.scale
  ((2, 8, 2), (2, 2, 4), 2.0)
  >>> bool(jnp.all(merge(weights)["layers"]["q_proj"] == 1.0))  # U = 0
  True
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import lowrank

# The decoder's projection matrices (attention and MLP): PEFT's
# "all-linear" for these models, the LM head aside.
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

_HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["base", "down", "up"],
    meta_fields=["scale", "path", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class LoraWeight:
  r"""One adapted matrix, :math:`W = W_0 + s\,D U`.

  Attributes:
    base: :math:`W_0`, ``[*layers, in, out]`` in the base dtype (frozen);
      None in the trainable part (:func:`trainable`).
    down: ``D``, ``[*layers, in, rank]`` float32.
    up: ``U``, ``[*layers, rank, out]`` float32.
    scale: :math:`s = \alpha / r`.
    path: the parameter's key path (for error messages and names).
    dtype: the parameter's own dtype (of the merged weight).
  """

  base: Any
  down: Any
  up: Any
  scale: float
  path: str
  dtype: str

  @property
  def rank(self) -> int:
    return self.down.shape[-1]


def is_lora(x) -> bool:
  """Whether ``x`` is a :class:`LoraWeight`."""
  return isinstance(x, LoraWeight)


def has_adapters(weights: Any) -> bool:
  """Whether any leaf of ``weights`` is a :class:`LoraWeight`."""
  return any(map(is_lora, jax.tree.leaves(weights, is_leaf=is_lora)))


def _names(path) -> list[str]:
  return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def _init_down(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  bound = 1.0 / np.sqrt(shape[-2])
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def add_adapters(
    params: Any,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] = DEFAULT_TARGETS,
    base_dtype: str = "float32",
    seed: int = 0,
) -> Any:
  """``params`` with a :class:`LoraWeight` at every targeted matrix.

  A leaf is targeted when one of the names in its key path is in
  ``targets`` (e.g. ``"q_proj"`` adapts ``layers/q_proj``, all layers at
  once).

  Args:
    params: dense parameters; targeted leaves laid out ``[*layers, in,
      out]``.
    rank: the adapters' rank ``r`` (at most ``min(in, out)``).
    alpha: the scale's numerator, :math:`s = \\alpha / r`.
    targets: parameter names to adapt.
    base_dtype: dtype of the frozen :math:`W_0`: ``"float32"`` or
      ``"bfloat16"``.
    seed: the seed of the down projections' draw (each leaf's key folds in
      its path).

  Returns:
    A tree like ``params``.

  Raises:
    ValueError: naming the problem, for a target no matrix carries, a
      targeted leaf with fewer than 2 axes, or a rank above a matrix's
      smaller side.
  """
  if rank < 1:
    raise ValueError(f"LoRA rank must be >= 1, got {rank}")
  if not alpha > 0:
    raise ValueError(f"LoRA alpha must be > 0, got {alpha}")
  if base_dtype not in ("float32", "bfloat16"):
    raise ValueError(
        f"base_dtype must be float32 or bfloat16, got {base_dtype!r}"
    )
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = {name for path, _ in flat for name in _names(path)}
  missing = sorted(set(targets) - names)
  if missing:
    raise ValueError(
        f"LoRA targets {missing} name no parameter of the model; its "
        f"parameters are {sorted(names)}"
    )
  leaves = []
  for path, p in flat:
    if not set(_names(path)) & set(targets):
      leaves.append(p)
      continue
    name = jax.tree_util.keystr(path)
    shape = tuple(jnp.shape(p))
    if len(shape) < 2:
      raise ValueError(
          f"LoRA target {name} has shape {shape}; adapters need a matrix "
          "[*layers, in, out]"
      )
    if rank > min(shape[-2:]):
      raise ValueError(
          f"LoRA rank {rank} exceeds the smaller side of {name} {shape}"
      )
    key = jax.random.fold_in(
        jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF
    )
    leaves.append(
        LoraWeight(
            base=jnp.asarray(p).astype(base_dtype),
            down=_init_down(key, shape[:-1] + (rank,)),
            up=jnp.zeros(shape[:-2] + (rank, shape[-1]), jnp.float32),
            scale=float(alpha) / rank,
            path=name,
            dtype=str(jnp.result_type(p)),
        )
    )
  return treedef.unflatten(leaves)


def trainable(weights: Any) -> Any:
  """The part of ``weights`` a step changes: each :class:`LoraWeight`
  without its base (None), every other leaf None (frozen)."""
  return jax.tree.map(
      lambda w: dataclasses.replace(w, base=None) if is_lora(w) else None,
      weights,
      is_leaf=is_lora,
  )


def with_frozen(adapters: Any, weights: Any) -> Any:
  """``adapters`` (from :func:`trainable`) completed with the frozen parts
  of ``weights``: the bases and the other leaves."""
  return jax.tree.map(
      lambda a, w: dataclasses.replace(a, base=w.base) if is_lora(w) else w,
      adapters,
      weights,
      is_leaf=lambda x: x is None or is_lora(x),
  )


def view(weights: Any) -> Any:
  r"""The weights as the model consumes them: each :class:`LoraWeight` as
  the :class:`~logra_jax.lowrank.LowRankDelta` :math:`W_0 + (s D) U`
  (``W_0`` under ``stop_gradient``, differentiable in ``D`` and ``U``)."""
  return jax.tree.map(
      lambda w: (
          lowrank.LowRankDelta(
              w.base, w.scale * w.down, w.up, rows=True, path=w.path
          )
          if is_lora(w)
          else w
      ),
      weights,
      is_leaf=is_lora,
  )


def merge(weights: Any, dtype: Optional[Any] = None) -> Any:
  r"""The dense weights: :math:`W_0 + s\,D U` at each :class:`LoraWeight`
  (in float32, then cast to the parameter's dtype or ``dtype``); other
  leaves as they are."""

  def dense(w):
    if not is_lora(w):
      return w
    term = jnp.einsum("...mr,...rn->...mn", w.down, w.up, precision=_HIGHEST)
    out = w.base.astype(jnp.float32) + w.scale * term
    return out.astype(w.dtype if dtype is None else dtype)

  return jax.tree.map(dense, weights, is_leaf=is_lora)
