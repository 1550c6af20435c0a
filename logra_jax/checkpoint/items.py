"""What a checkpoint's items hold, and the targets they are read into.

A checkpoint holds the arrays (``params``, ``opt_state``, ``ref_params``),
the host side of the loop (:class:`LoopState`) and the run's description;
:meth:`~logra_jax.checkpoint.Checkpointer.restore` returns them as one
:class:`Restored`, read into the shapes, dtypes and shardings of
:func:`abstract_state` targets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The checkpoint items that hold arrays.
ARRAY_ITEMS = ("params", "opt_state", "ref_params")


@dataclasses.dataclass
class LoopState:
  """The host side of a run that a checkpoint restores.

  Attributes:
    step: learner steps done.
    key: the run's typed PRNG key (``jax.random.key``) after ``step`` steps.
    data_position: prompt batches drawn so far.
    history: per-step metrics, as written to ``metrics.jsonl``.
    extras: other JSON values the trainer carries over (e.g. the held-out
      accuracy before RL).

  Example:
    >>> import json
    >>> loop = LoopState(step=3, key=jax.random.key(7), data_position=3)
    >>> back = LoopState.from_json(json.loads(json.dumps(loop.to_json())))
    >>> back.step, bool((jax.random.key_data(back.key)
    ...                  == jax.random.key_data(loop.key)).all())
    (3, True)
  """

  step: int
  key: jax.Array
  data_position: int
  history: list[dict[str, float]] = dataclasses.field(default_factory=list)
  extras: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    """A JSON-serializable dict (the key as its implementation and words)."""
    return {
        "step": int(self.step),
        "data_position": int(self.data_position),
        "key": {
            "impl": str(jax.random.key_impl(self.key)),
            "data": np.asarray(jax.random.key_data(self.key)).tolist(),
        },
        "history": self.history,
        "extras": self.extras,
    }

  @classmethod
  def from_json(cls, value: dict[str, Any]) -> LoopState:
    """Inverse of :meth:`to_json`."""
    key = jax.random.wrap_key_data(
        np.asarray(value["key"]["data"], np.uint32), impl=value["key"]["impl"]
    )
    return cls(
        step=int(value["step"]),
        key=key,
        data_position=int(value["data_position"]),
        history=list(value["history"]),
        extras=dict(value["extras"]),
    )


@dataclasses.dataclass
class Restored:
  """What :meth:`~logra_jax.checkpoint.Checkpointer.restore` returns.

  Attributes:
    step: the checkpoint's step.
    params: policy parameters, placed with the requested shardings.
    opt_state: optimizer state, placed likewise.
    ref_params: reference parameters, or None when none were asked for.
    loop: the host-side loop state.
    meta: the checkpoint's description
      (:func:`~logra_jax.checkpoint.run_meta`).
  """

  step: int
  params: Any
  opt_state: Any
  ref_params: Any
  loop: LoopState
  meta: dict[str, Any]


def abstract_state(tree: Any, shardings: Any = None) -> Any:
  """``jax.ShapeDtypeStruct`` leaves with shardings: the restore target.

  Args:
    tree: arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
    shardings: a tree of shardings like ``tree``, one sharding for all
      leaves, or None to keep each leaf's own ``.sharding``.

  Returns:
    A tree like ``tree`` of ``jax.ShapeDtypeStruct``.

  Example:
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> abstract_state({"w": jnp.zeros((2, 3))}, one)["w"].shape
    (2, 3)
  """

  def leaf(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  if shardings is None:
    return jax.tree.map(lambda x: leaf(x, x.sharding), tree)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: leaf(x, shardings), tree)
  return jax.tree.map(leaf, tree, shardings)


def without_empty(tree: Any) -> Any:
  """``tree`` with None for its arrays of no elements, which Orbax cannot
  write and which hold no data."""
  return jax.tree.map(lambda x: None if x.size == 0 else x, tree)


def with_empty(restored: Any, target: Any) -> Any:
  """``restored`` (read for :func:`without_empty` of ``target``) with the
  arrays of no elements rebuilt from the abstract ``target``."""

  def leaf(want, got):
    if want.size:
      return got
    return jnp.zeros(want.shape, want.dtype, device=want.sharding)

  return jax.tree.map(leaf, target, restored)
