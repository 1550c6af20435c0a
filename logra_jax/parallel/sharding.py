"""The device mesh and the one partition table of logra-jax.

Axes: ``dp`` (data parallel: replicas of the weights), ``fsdp`` (weights,
gradients and optimizer state split over devices, data split too) and ``tp``
(tensor parallel: heads, MLP width and vocabulary split). Any axis may be 1.

Weights carry logical axis names (``models.LOGICAL_AXES``); ``PARTITION_RULES``
maps them, and the activations' batch axis, to mesh axes. Optimizer state
(including LoGRA's projectors and sketches) takes the sharding that XLA
propagates from the parameters through one optimizer update, so that the
state of a step is laid out exactly as the update produces it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
import warnings
from typing import Any, Optional, Sequence

from flax import nnx
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from logra_jax.optim import factored as factored_lib
from logra_jax.optim import lora as lora_lib

MESH_AXES = ("dp", "fsdp", "tp")

# Logical axis -> mesh axes. Weights: the hidden axis is split by fsdp, the
# head / MLP axes by tp, the stacked-layer axis never. The vocabulary tables
# (embeddings, LM head) are split along the vocabulary over fsdp and tp, so the
# output layer runs vocabulary-parallel: each device computes its vocabulary
# slice of the logits for the whole fsdp group's tokens ("vocab_batch": the
# batch axis there), and no device holds a whole [D, V] weight or gradient.
# Activations: the batch axis is split over every data axis.
PARTITION_RULES: dict[str, Optional[str | tuple[str, ...]]] = {
    "layers": None,
    "embed": "fsdp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "vocab": ("fsdp", "tp"),
    "batch": ("dp", "fsdp"),
    "sketch_long": ("dp", "fsdp"),
    "vocab_batch": "dp",
    "cache_kv_heads": "tp",
}

# Used for a dimension that its PARTITION_RULES axes do not divide (e.g.
# GPT-2's 50257 tokens over fsdp=8); the dimension is then split as here:
# the vocabulary over tp only; the KV cache's key/value heads (a grouped-query
# model's few, e.g. 2 over tp=4) not at all, each tp device holding them all;
# a sketch's thin factor or coordinates along a weight's long side (the
# sketch-direct gradient's [*layers, long, k] arrays, e.g. a projected
# vocabulary of 100 over fsdp=8) not at all.
FALLBACK_RULES: dict[str, Optional[str | tuple[str, ...]]] = {
    "vocab": "tp",
    "cache_kv_heads": None,
    "sketch_long": None,
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; their product is the number of devices.

  Example:
    >>> MeshConfig.parse("fsdp=4,tp=2")
    MeshConfig(dp=1, fsdp=4, tp=2)
  """

  dp: int = 1
  fsdp: int = 1
  tp: int = 1

  def __post_init__(self):
    for axis in MESH_AXES:
      size = getattr(self, axis)
      if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"mesh axis {axis} must be a positive int, got " f"{size!r}"
        )

  @property
  def size(self) -> int:
    return self.dp * self.fsdp * self.tp

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.dp, self.fsdp, self.tp)

  @classmethod
  def parse(cls, text: str | Sequence[str]) -> MeshConfig:
    """From ``"dp=2,fsdp=4"`` or ``["dp=2", "fsdp=4"]`` (missing axes are 1).

    Raises:
      ValueError: naming the entry that is not ``axis=size``, names an axis
        not in :data:`MESH_AXES` or one given before, or whose size is not a
        positive int.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    sizes = {}
    for item in (i.strip() for i in items if i.strip()):
      axis, sep, value = (part.strip() for part in item.partition("="))
      if not sep or axis not in MESH_AXES:
        raise ValueError(
            f"mesh entry {item!r}: expected axis=size with axis "
            f"in {MESH_AXES}"
        )
      if axis in sizes:
        raise ValueError(
            f"mesh entry {item!r}: axis {axis} is given twice "
            f"(already {axis}={sizes[axis]})"
        )
      # Decimal digits only: Python's int() also reads "1_0" as 10.
      if not re.fullmatch(r"[+-]?[0-9]+", value):
        raise ValueError(f"mesh entry {item!r}: size must be an int")
      sizes[axis] = int(value)
      if sizes[axis] < 1:
        raise ValueError(f"mesh entry {item!r}: size must be a positive int")
    return cls(**sizes)

  def __str__(self) -> str:
    return ",".join(f"{a}={getattr(self, a)}" for a in MESH_AXES)


def make_mesh(
    config: MeshConfig, devices: Optional[Sequence[jax.Device]] = None
) -> Mesh:
  """The ``(dp, fsdp, tp)`` mesh over ``devices`` (default: all devices).

  Raises:
    ValueError: if the mesh size differs from the number of devices.

  Example:
    >>> mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    >>> dict(mesh.shape)
    {'dp': 1, 'fsdp': 1, 'tp': 1}
  """
  devices = list(jax.devices() if devices is None else devices)
  if config.size != len(devices):
    raise ValueError(
        f"mesh {config} needs {config.size} devices, but "
        f"{len(devices)} are given"
    )
  return Mesh(
      np.asarray(devices).reshape(config.shape),
      MESH_AXES,
      axis_types=(AxisType.Auto,) * len(MESH_AXES),
  )


def _mesh_axes_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def _present_axes(mesh: Mesh, axes):
  """``axes`` without the mesh axes of size 1 (they shard nothing)."""
  if axes is None:
    return None
  kept = tuple(
      a
      for a in ((axes,) if isinstance(axes, str) else axes)
      if mesh.shape[a] > 1
  )
  return None if not kept else kept[0] if len(kept) == 1 else kept


def logical_to_mesh(
    logical_axes: Sequence[Optional[str]],
    mesh: Mesh,
    rules: Optional[dict] = None,
    *,
    shape: Optional[Sequence[int]] = None,
    name: str = "array",
) -> NamedSharding:
  """The sharding of an array from its logical axis names: the one mapper.

  Weights (their ``out_sharding`` metadata), optimizer state, activations
  (:func:`constrain`), the sampler and the memory planner all map logical
  axes to the mesh here. Each name is looked up in ``rules`` (default
  :data:`PARTITION_RULES`); a name missing from the rules, and a mesh axis of
  size 1, shard nothing. With ``shape``, a dimension that its mesh axes do
  not divide falls back to :data:`FALLBACK_RULES` (the vocabulary: split
  over ``tp`` only; the KV cache's key/value heads: not split), so every
  caller picks the same layout for the same array.

  Args:
    logical_axes: one logical name (or None) per dimension; may be shorter
      than the array (the rest replicated).
    mesh: the device mesh.
    rules: logical name -> mesh axis, tuple of axes, or None.
    shape: the array's shape, to check divisibility and apply the fallback;
      None trusts the rules as given.
    name: how errors name the array.

  Raises:
    ValueError: naming the array, dimension and sizes, if no rule divides a
      dimension.

  Example:
    >>> mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    >>> logical_to_mesh(("embed", "mlp"), mesh).spec
    P(None, None)
  """
  rules = PARTITION_RULES if rules is None else rules
  spec = []
  for dim, logical in enumerate(logical_axes):
    axes = _present_axes(mesh, None if logical is None else rules.get(logical))
    if shape is not None:
      size = shape[dim]
      if size % _mesh_axes_size(mesh, axes) and logical in FALLBACK_RULES:
        axes = _present_axes(mesh, FALLBACK_RULES[logical])
      parts = _mesh_axes_size(mesh, axes)
      if size % parts:
        raise ValueError(
            f"cannot shard {name} (shape {tuple(shape)}): dimension {dim} "
            f"({logical!r}, size {size}) is not divisible by mesh axis "
            f"{axes} of size {parts}"
        )
    spec.append(axes)
  return NamedSharding(mesh, PartitionSpec(*spec))


_ACTIVATION_LAYOUT: contextvars.ContextVar = contextvars.ContextVar(
    "logra_activation_layout", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Optional[dict] = None):
  """Within this context, traced model code pins its activations to ``mesh``
  by their logical axes (:func:`constrain`); outside it, nothing is pinned.

  Example:
    >>> mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    >>> with activation_sharding(mesh):
    ...   y = jax.jit(lambda x: constrain(x, ("batch", None)))(np.ones((2, 3)))
  """
  token = _ACTIVATION_LAYOUT.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVATION_LAYOUT.reset(token)


def constrain(x: jax.Array, logical_axes: tuple[Optional[str], ...]) -> Any:
  """``x`` pinned to the layout :func:`logical_to_mesh` gives its logical axes
  ("batch", "vocab", ..., None for replicated) under
  :func:`activation_sharding`; outside it, ``x`` unchanged."""
  active = _ACTIVATION_LAYOUT.get()
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(
      x,
      logical_to_mesh(
          logical_axes, mesh, rules, shape=x.shape, name="activation"
      ),
  )


def param_shardings(
    params: nnx.State, mesh: Mesh, rules: Optional[dict] = None
) -> Any:
  """Shardings of the model parameters, from their logical axis metadata.

  Args:
    params: from ``models.split_model`` (concrete or abstract), whose
      ``nnx.Param`` leaves carry ``out_sharding`` logical names.
    mesh: from :func:`make_mesh`.
    rules: logical -> mesh axes; default :data:`PARTITION_RULES`.

  Returns:
    A tree like ``params`` with a ``NamedSharding`` in place of each array.
  """
  is_param = lambda x: isinstance(x, nnx.Variable)

  def shard(path, variable):
    logical = variable.get_metadata().get("out_sharding")
    if logical is None:
      logical = (None,) * len(variable.shape)
    return variable.replace(
        logical_to_mesh(
            logical,
            mesh,
            rules,
            shape=variable.shape,
            name=jax.tree_util.keystr(path),
        )
    )

  return jax.tree_util.tree_map_with_path(shard, params, is_leaf=is_param)


def weight_shardings(
    weights: Any,
    params_shardings: Any,
    mesh: Mesh,
    rules: Optional[dict] = None,
) -> Any:
  """Shardings of the learner's weights, factored or not.

  A factored weight (``logra_jax.optim.factored.FactoredWeight``) keeps its
  base ``B`` laid out like its parameter; its coordinates ``A``
  (``[batch, rank, short]``) split the short axis like the parameter's
  hidden axis (``"embed"``) where that divides it, else are replicated, and
  its per-matrix scales are replicated. A LoRA weight
  (``logra_jax.optim.lora.LoraWeight``) keeps its base laid out like its
  parameter, its down projection ``[*layers, in, rank]`` split along
  ``in`` and its up projection ``[*layers, rank, out]`` along ``out``, each
  over the mesh axes of that side of the parameter, or of its other side
  where that one alone is split (the rank replicated). Other leaves keep the
  parameter's sharding.

  Args:
    weights: the learner's weights (concrete or abstract).
    params_shardings: :func:`param_shardings` of the dense params.
    mesh: the mesh.
    rules: logical -> mesh axes; default :data:`PARTITION_RULES`.
  """
  rules = PARTITION_RULES if rules is None else rules
  replicated = NamedSharding(mesh, PartitionSpec())
  axes = _present_axes(mesh, rules.get("embed"))

  def coords_sharding(shape):
    if shape[-1] % _mesh_axes_size(mesh, axes):
      return replicated
    return NamedSharding(mesh, PartitionSpec(None, None, axes))

  def lora_leaf(w, sharding):
    spec = tuple(sharding.spec) + (None,) * (
        len(w.base.shape) - len(sharding.spec)
    )
    layers, rows, cols = spec[:-2], spec[-2], spec[-1]

    def long_side(own, other, size):
      """The mesh axes of an adapter's long side: its weight's on that side,
      else the weight's other side's (where they divide it), so that both
      adapters are split even when the weight is split along one side."""
      if own is not None or other is None:
        return own
      return None if size % _mesh_axes_size(mesh, other) else other

    m, n = w.base.shape[-2:]
    return dataclasses.replace(
        w,
        base=sharding,
        down=NamedSharding(
            mesh, PartitionSpec(*layers, long_side(rows, cols, m), None)
        ),
        up=NamedSharding(
            mesh, PartitionSpec(*layers, None, long_side(cols, rows, n))
        ),
    )

  def leaf(w, sharding):
    if lora_lib.is_lora(w):
      return lora_leaf(w, sharding)
    if not factored_lib.is_factored(w):
      return sharding
    return dataclasses.replace(
        w,
        base=sharding,
        coords=coords_sharding(w.coords.shape),
        scale=None if w.scale is None else replicated,
    )

  flat, treedef = jax.tree.flatten(
      weights,
      is_leaf=lambda x: factored_lib.is_factored(x) or lora_lib.is_lora(x),
  )
  return treedef.unflatten(
      [
          leaf(w, s)
          for w, s in zip(flat, treedef.flatten_up_to(params_shardings))
      ]
  )


def batch_sharding(
    mesh: Mesh, ndim: int, rules: Optional[dict] = None
) -> NamedSharding:
  """Leading (batch) axis split over the data axes; the rest replicated."""
  return logical_to_mesh(("batch",) + (None,) * (ndim - 1), mesh, rules)


def data_shardings(batch: Any, mesh: Mesh) -> Any:
  """Shardings of a batch pytree: every array split along its leading axis.

  Raises:
    ValueError: if the batch size is not divisible by the data axes.
  """

  def shard(path, x):
    sharding = batch_sharding(mesh, x.ndim)
    parts = _mesh_axes_size(mesh, sharding.spec[0] if x.ndim else None)
    if x.ndim and x.shape[0] % parts:
      raise ValueError(
          f"cannot shard batch field {jax.tree_util.keystr(path)} (shape "
          f"{tuple(x.shape)}): batch size {x.shape[0]} is not divisible by "
          f"the data axes of size {parts}"
      )
    return sharding

  return jax.tree_util.tree_map_with_path(shard, batch)


def optimizer_state_shardings(
    tx: optax.GradientTransformation, params: Any, shardings: Any, mesh: Mesh
) -> Any:
  """Shardings of ``tx``'s state that follow the parameters' shardings.

  Lowers one ``tx.update`` with parameters and gradients sharded as
  ``shardings`` and reads the state layout XLA chooses for its output:
  moments of dense leaves match their parameter, LoGRA projectors split the
  parameter's long axis and sketches its short one, scalars are replicated.

  Args:
    tx: the optimizer.
    params: parameters (concrete or ``jax.ShapeDtypeStruct``).
    shardings: parameter shardings (:func:`param_shardings`).
    mesh: the mesh.

  Returns:
    A tree like ``jax.eval_shape(tx.init, params)`` of ``NamedSharding``.
  """
  abstract = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params
  )
  state = jax.eval_shape(tx.init, abstract)
  replicated = NamedSharding(mesh, PartitionSpec())
  extra = {}
  if isinstance(tx, optax.GradientTransformationExtraArgs):
    extra["kl_predictor"] = lambda update: jax.numpy.zeros([])
  probe = jax.jit(
      lambda grads, state, params: tx.update(grads, state, params, **extra),
      in_shardings=(
          shardings,
          jax.tree.map(lambda _: replicated, state),
          shardings,
      ),
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    compiled = probe.lower(abstract, state, abstract).compile()
  _, state_out = compiled.output_shardings

  def named(sharding, leaf):
    if isinstance(sharding, NamedSharding):
      return sharding
    # XLA reports fully replicated outputs as a GSPMD sharding.
    if sharding.is_fully_replicated:
      return replicated
    raise ValueError(
        f"unexpected optimizer state sharding {sharding} for a "
        f"leaf of shape {leaf.shape}"
    )

  return jax.tree.map(named, state_out, state)
