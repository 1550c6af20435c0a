"""Policy sync: messages that move a copy of the factored policy to the
learner's, bit for bit.

The learner's policy is factored (:mod:`logra_jax.optim.factored`): each
projected weight is ``W = c B + P A`` and only ``A`` (``[batch, rank,
short]``), ``c`` and the dense leaves change within a projector window; ``B``
changes only when a window is merged, ``B <- round(c B + P A)``, which a
receiver holding the same ``B``, ``P`` and ``A`` computes itself with the
same program and the same rounding bits (:func:`factored.merge`). A
:class:`SyncMessage` therefore carries, per step:

* every leaf's coordinates ``A`` and scale ``c`` (the window's sum of step
  factors, not the step's own factor: the same size, and a message applies
  exactly, with no float arithmetic on the receiver);
* the dense leaves' new values;
* with LoRA adapters (:mod:`logra_jax.optim.lora`) instead of a factored
  policy: every adapter's ``D`` and ``U``; the frozen weights travel only in
  full messages;
* at a refresh, the step of the merge and the new window's projectors ``P``;
* a checksum of every array the receiver must end with
  (:func:`logra_jax.checksums.leaf_checksums`, computed on the device), a
  sequence number, the policy version and a signature of the layout.

A full message (``full=True``, a *resync*) carries every array, bases
included. :class:`PolicyReceiver` verifies a message, applies it to a new
copy and commits it only when every checksum matches: a message that does
not fit (another model or layout, a sequence number out of order, a missing
or misshapen array, a checksum mismatch) raises :class:`SyncError` and the
receiver keeps its weights. :func:`encode` / :func:`decode` turn messages into
bytes (msgpack arrays behind a checked header, never pickle) for a receiver
in another process.

Example:
  >>> import jax, jax.numpy as jnp, logra_jax as logra
  >>> from logra_jax.optim import factored
  >>> params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
  >>> tx = logra.logra(1e-2, rank=2, refresh_every=2, factored=True)
  >>> state = tx.init(params)
  >>> weights = factored.factor(params, state)
  >>> sender = PolicySender(weights, state, seed=0)
  >>> receiver = PolicyReceiver(policy_state.synced_state(weights, state), seed=0)
  >>> receiver.apply(decode(encode(sender.message(weights, state, full=True))))
  >>> receiver.version, sorted(receiver.state)
  (0, ['projectors', 'weights'])
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct
import zlib
from typing import Any, Optional

from flax import serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax import checksums
from logra_jax import policy_state
from logra_jax.optim import sketch_grad
from logra_jax.optim import factored as factored_lib
from logra_jax.optim import lora as lora_lib
from logra_jax.optim import state_queries
from logra_jax.optim.types import ProjectState

FORMAT_VERSION = 1
_MAGIC = b"LOGRASYN"
_HEADER = struct.Struct("<8sIQI")  # magic, format, payload length, CRC-32

BASE, COORDS, SCALE, PROJECTOR, DENSE, ADAPTER, FROZEN = (
    "base",
    "coords",
    "scale",
    "projector",
    "dense",
    "adapter",
    "frozen",
)
# The kinds of array every message carries (the others: full messages, and
# projectors after a merge).
_EVERY_STEP = (COORDS, SCALE, DENSE, ADAPTER)


class SyncError(ValueError):
  """A sync message that does not fit the receiver; its weights are kept."""


@dataclasses.dataclass(frozen=True)
class SyncMessage:
  """One step of the learner's policy (or all of it, ``full``).

  Attributes:
    sequence: this message's number; a receiver applies ``n + 1`` after
      ``n`` (a full message resets the sequence to its own).
    version: the learner's optimizer steps behind these weights.
    signature: :func:`signature` of the policy layout.
    full: every array (a resync), else the arrays a step changes.
    merge_step: the step (rounding key) of the window merge the learner made
      before this update, or -1 when it made none.
    arrays: name -> array (see :func:`named_arrays`).
    checksums: name -> uint32 checksum of every array the receiver must end
      with.
  """

  sequence: int
  version: int
  signature: str
  full: bool
  merge_step: int
  arrays: dict[str, Any]
  checksums: dict[str, int]

  @property
  def nbytes(self) -> int:
    """Bytes of the arrays it carries."""
    return sum(x.nbytes for x in self.arrays.values())


def named_arrays(state: dict[str, Any]) -> dict[str, tuple[str, Any]]:
  """``{name: (kind, array)}`` of a :func:`~logra_jax.policy_state.synced_state`.

  Names are the leaves' key paths (``jax.tree_util.keystr``) with the part of
  a factored weight appended (``.base``, ``.coords``, ``.scale``) or of a
  LoRA weight (``.base``, ``.down``, ``.up``); a projector's name is its
  weight's, prefixed ``projector:``. Kinds: ``"base"``, ``"coords"``,
  ``"scale"``, ``"projector"``, ``"dense"``, ``"adapter"`` and, beside
  adapters, ``"frozen"`` (every other leaf).
  """
  out = {}
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      state["weights"], is_leaf=policy_state.is_structured
  )
  projectors = treedef.flatten_up_to(state["projectors"])
  other = FROZEN if lora_lib.has_adapters(state["weights"]) else DENSE
  for (path, w), p in zip(flat, projectors):
    name = jax.tree_util.keystr(path)
    if lora_lib.is_lora(w):
      out[f"{name}.base"] = (BASE, w.base)
      out[f"{name}.down"] = (ADAPTER, w.down)
      out[f"{name}.up"] = (ADAPTER, w.up)
      continue
    if not factored_lib.is_factored(w):
      out[name] = (other, w)
      continue
    out[f"{name}.base"] = (BASE, w.base)
    out[f"{name}.coords"] = (COORDS, w.coords)
    if w.scale is not None:
      out[f"{name}.scale"] = (SCALE, w.scale)
    out[f"projector:{name}"] = (PROJECTOR, p)
  return out


def signature(state: dict[str, Any], **fields: Any) -> str:
  """A digest of the layout of ``state`` (every array's name, shape and
  dtype) and of ``fields`` (e.g. the model config, the optimizer's rank and
  projector kind): two policies with the same signature can sync."""
  layout = [
      (name, list(np.shape(x)), str(jnp.result_type(x)))
      for name, (_, x) in sorted(named_arrays(state).items())
  ]
  text = json.dumps(
      {"layout": layout, "fields": fields}, sort_keys=True, default=str
  )
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _checksums(arrays: dict[str, Any]) -> dict[str, int]:
  names = sorted(arrays)
  values = jax.device_get(checksums.leaf_checksums([arrays[n] for n in names]))
  return {n: int(v) for n, v in zip(names, values)}


def _merges(state: Optional[ProjectState], since: Optional[int]) -> list[int]:
  """The steps of the merges the updates since the ``project`` stage's count
  ``since`` were preceded by (None: the last update's): the learner merges
  (``factored.merge_at_refresh``) when the count is a multiple of
  ``refresh_every``, then counts the update."""
  if state is None:
    return []
  count = int(state.count)
  first = count - 1 if since is None else since
  every = state.spec.config.refresh_every
  return [m for m in range(max(first, 0), count) if m % every == 0]


class PolicySender:
  """The learner's side: builds each step's :class:`SyncMessage`.

  Args:
    weights, opt_state: the learner's weights and optimizer state (for the
      layout and the signature).
    seed: the run's seed (the merge's rounding key).
    **fields: more to put in the signature (model config, rank, ...).
  """

  def __init__(
      self, weights: Any, opt_state: optax.OptState, *, seed: int, **fields: Any
  ):
    self.signature = signature(
        policy_state.synced_state(weights, opt_state), seed=seed, **fields
    )
    self.sequence = -1
    self._window = None  # (window index, its projectors)
    self._count = None  # the project stage's count at the last message

  def _state(self, weights: Any, opt_state: optax.OptState) -> dict[str, Any]:
    """:func:`~logra_jax.policy_state.synced_state`, with ``"random"`` projectors regenerated once
    per window. Stored ones are read from ``opt_state`` at every call: the
    learner's step may donate the arrays of the state before it."""
    project = sketch_grad.project_state(opt_state)
    if project is None or project.spec.config.kind != "random":
      return policy_state.synced_state(weights, opt_state)
    window = (int(project.count) - 1) // project.spec.config.refresh_every
    if self._window is None or self._window[0] != window:
      self._window = (window, state_queries.window_projectors(opt_state))
    return {"weights": weights, "projectors": self._window[1]}

  def message(
      self,
      weights: Any,
      opt_state: optax.OptState,
      *,
      version: Optional[int] = None,
      full: bool = False,
  ) -> SyncMessage:
    """The message that moves a receiver from the last message's weights to
    these (``full``: from anything).

    Args:
      weights, opt_state: the learner's state after its update.
      version: the policy version; default the ``project`` stage's count
      (without one, the message's sequence number).
      full: carry every array (a resync). A message is also full when the
        receiver could not follow the updates since the last one: a merge
        after the first of them (several updates per message, e.g.
        ``num_iterations > 1``), whose window the receiver never held.
    """
    project = sketch_grad.project_state(opt_state)
    named = named_arrays(self._state(weights, opt_state))
    merges = _merges(project, self._count)
    full = (
        full
        or self.sequence < 0  # a receiver starts from a full one
        or any(m != self._count for m in merges)
    )
    merge_step = merges[-1] if merges else -1
    sent = lambda kind: (
        full or kind in _EVERY_STEP or (kind == PROJECTOR and merge_step >= 0)
    )
    self.sequence += 1
    self._count = None if project is None else int(project.count)
    if version is None:
      version = self.sequence if project is None else int(project.count)
    return SyncMessage(
        sequence=self.sequence,
        version=version,
        signature=self.signature,
        full=full,
        merge_step=merge_step,
        arrays={n: x for n, (kind, x) in named.items() if sent(kind)},
        checksums=_checksums({n: x for n, (_, x) in named.items()}),
    )


@functools.partial(jax.jit, static_argnames="seed")
def _merge(weights, projectors, step, seed):
  return factored_lib.merge(weights, projectors, seed=seed, step=step)


class PolicyReceiver:
  """A copy of the learner's policy, moved by :class:`SyncMessage`.

  It accepts messages whose signature is its own (the layout of
  ``template``, the seed and ``fields``, as the :class:`PolicySender`'s):
  a full message first, then each later one in order. ``state`` is always
  what some message left, verified by its checksums.

  Args:
    template: a :func:`~logra_jax.policy_state.synced_state` of the learner's layout (arrays, e.g.
      its initial state, or ``jax.ShapeDtypeStruct``s) giving the tree the
      arrays are placed in.
    seed: the run's seed (the merge's rounding key).
    **fields: as given to the sender (model config, rank, ...).

  Attributes:
    state: the :func:`~logra_jax.policy_state.synced_state` held (``template`` until the first full
      message).
    signature: the layout it accepts.
    sequence, version: of the last message applied (-1 before the first).
  """

  def __init__(self, template: dict[str, Any], *, seed: int, **fields: Any):
    self.state = template
    self.signature = signature(template, seed=seed, **fields)
    self.seed = seed
    self.sequence = -1
    self.version = -1

  def apply(self, message: SyncMessage) -> None:
    """Verifies ``message`` and moves the weights to it.

    Raises:
      SyncError: the message is for another layout or configuration, out of
        order, older than the weights held, missing or misshapen arrays, or
        the result's checksums differ from the learner's; the receiver's
        state is unchanged.
    """
    if not isinstance(message, SyncMessage):
      raise SyncError(f"expected a SyncMessage, got {type(message).__name__}")
    if message.signature != self.signature:
      raise SyncError(
          f"message for another policy (signature {message.signature[:12]}"
          f"..., this receiver {self.signature[:12]}...): the model, shapes, "
          "dtypes, seed or optimizer settings of learner and receiver differ"
      )
    if not message.full and self.version < 0:
      raise SyncError(
          f"message {message.sequence} is not a full message; a "
          "receiver starts from one"
      )
    if not message.full and message.sequence != self.sequence + 1:
      raise SyncError(
          f"message {message.sequence} out of order: expected "
          f"{self.sequence + 1} ("
          + (
              "a duplicate or an old message"
              if message.sequence <= self.sequence
              else "messages were lost"
          )
          + "); a full resync restarts it"
      )
    if message.version < self.version:
      raise SyncError(
          f"message of policy version {message.version} is older "
          f"than the version held ({self.version})"
      )
    named = named_arrays(self.state)
    state = self.state
    if not message.full and message.merge_step >= 0:
      state = dict(
          state,
          weights=_merge(
              state["weights"],
              state["projectors"],
              jnp.asarray(message.merge_step, jnp.int32),
              seed=self.seed,
          ),
      )
    expected = {
        n
        for n, (kind, _) in named.items()
        if message.full
        or kind in _EVERY_STEP
        or (kind == PROJECTOR and message.merge_step >= 0)
    }
    missing = sorted(expected - set(message.arrays))
    extra = sorted(set(message.arrays) - expected)
    if missing or extra:
      raise SyncError(
          f"message {message.sequence} does not fit the layout: "
          f"missing {missing[:3]}, unexpected {extra[:3]}"
      )
    state = _replace(state, message.arrays)
    got = _checksums({n: x for n, (_, x) in named_arrays(state).items()})
    if set(got) != set(message.checksums):
      raise SyncError(
          f"message {message.sequence} has checksums for other "
          "arrays than the layout's"
      )
    wrong = sorted(n for n in got if got[n] != message.checksums[n])
    if wrong:
      raise SyncError(
          f"message {message.sequence}: checksum mismatch after applying it "
          f"for {len(wrong)} array(s), e.g. {wrong[:3]}; the weights are "
          "kept (a full resync heals them)"
      )
    self.state = state
    self.sequence = message.sequence
    self.version = message.version

  def effective_weights(self, dtype: Any = None) -> Any:
    """The dense weights ``c B + P A`` held (:func:`materialize`, jitted)."""
    return _materialize(self.state, dtype=dtype)


def materialize(state: dict[str, Any], dtype: Any = None) -> Any:
  """The dense weights of a :func:`~logra_jax.policy_state.synced_state`, ``c B + P A`` for factored
  ones (``factored.effective_weights``), ``W_0 + s D U`` for LoRA ones
  (``lora.merge``), each in its parameter's dtype or ``dtype``."""
  if lora_lib.has_adapters(state["weights"]):
    return lora_lib.merge(state["weights"], dtype)
  return factored_lib.effective_weights(
      state["weights"], state["projectors"], dtype
  )


_materialize = jax.jit(materialize, static_argnames="dtype")


def _replace(state: dict[str, Any], arrays: dict[str, Any]) -> dict[str, Any]:
  """``state`` with the named arrays replaced (shapes and dtypes checked)."""

  def take(name, old):
    if name not in arrays:
      return old
    new = arrays[name]
    if tuple(np.shape(new)) != tuple(np.shape(old)) or jnp.result_type(
        new
    ) != jnp.result_type(old):
      raise SyncError(
          f"array {name}: shape {tuple(np.shape(new))} "
          f"{jnp.result_type(new)} does not fit "
          f"{tuple(np.shape(old))} {jnp.result_type(old)}"
      )
    # A copy, placed like the array it replaces: never the sender's buffers
    # (which its next step may donate).
    sharding = getattr(old, "sharding", None)
    if sharding is None:
      return jnp.array(new, copy=True)
    return jax.device_put(new, sharding, may_alias=False)

  flat, treedef = jax.tree_util.tree_flatten_with_path(
      state["weights"], is_leaf=policy_state.is_structured
  )
  projectors = treedef.flatten_up_to(state["projectors"])
  weights, new_projectors = [], []
  for (path, w), p in zip(flat, projectors):
    name = jax.tree_util.keystr(path)
    if lora_lib.is_lora(w):
      weights.append(
          dataclasses.replace(
              w,
              base=take(f"{name}.base", w.base),
              down=take(f"{name}.down", w.down),
              up=take(f"{name}.up", w.up),
          )
      )
      new_projectors.append(p)
      continue
    if not factored_lib.is_factored(w):
      weights.append(take(name, w))
      new_projectors.append(p)
      continue
    weights.append(
        dataclasses.replace(
            w,
            base=take(f"{name}.base", w.base),
            coords=take(f"{name}.coords", w.coords),
            scale=None if w.scale is None else take(f"{name}.scale", w.scale),
        )
    )
    new_projectors.append(take(f"projector:{name}", p))
  return {
      "weights": treedef.unflatten(weights),
      "projectors": treedef.unflatten(new_projectors),
  }


def encode(message: SyncMessage) -> bytes:
  """``message`` as bytes: a header (magic, format version, payload length,
  CRC-32 of the payload) and a msgpack payload of the fields and the arrays
  (``flax.serialization``; no pickle)."""
  return b"".join(encode_parts(message))


def encode_parts(message: SyncMessage) -> tuple[bytes, bytes]:
  """:func:`encode`'s header and payload, not joined (a transport sends them
  one after the other instead of copying a large message once more)."""
  payload = serialization.msgpack_serialize(
      {
          "sequence": message.sequence,
          "version": message.version,
          "signature": message.signature,
          "full": message.full,
          "merge_step": message.merge_step,
          "arrays": {n: np.asarray(x) for n, x in message.arrays.items()},
          "checksums": dict(message.checksums),
      }
  )
  return (
      _HEADER.pack(_MAGIC, FORMAT_VERSION, len(payload), zlib.crc32(payload)),
      payload,
  )


def decode(data: bytes | bytearray | memoryview) -> SyncMessage:
  """The :class:`SyncMessage` of :func:`encode`'s bytes.

  Raises:
    SyncError: not a sync message, another format version, truncated or
      corrupted bytes, or fields of the wrong type.
  """
  if len(data) < _HEADER.size:
    raise SyncError(
        f"sync message truncated: {len(data)} bytes, shorter " "than its header"
    )
  magic, version, length, crc = _HEADER.unpack_from(data)
  if magic != _MAGIC:
    raise SyncError("not a logra-jax sync message (bad magic bytes)")
  if version != FORMAT_VERSION:
    raise SyncError(
        f"sync message format {version}; this version reads "
        f"format {FORMAT_VERSION}"
    )
  payload = memoryview(data)[_HEADER.size :]  # not a copy
  if len(payload) != length:
    raise SyncError(
        f"sync message truncated or padded: payload of "
        f"{len(payload)} bytes, header says {length}"
    )
  if zlib.crc32(payload) != crc:
    raise SyncError("sync message corrupted: CRC-32 of its payload differs")
  try:
    fields = serialization.msgpack_restore(payload)
  except Exception as e:  # noqa: BLE001 (any msgpack failure)
    raise SyncError(f"sync message payload unreadable: {e}") from None
  if not isinstance(fields, dict):
    raise SyncError("sync message payload is not a map of fields")
  types = {
      "sequence": int,
      "version": int,
      "signature": str,
      "full": bool,
      "merge_step": int,
      "arrays": dict,
      "checksums": dict,
  }
  for name, kind in types.items():
    value = fields.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
      raise SyncError(
          f"sync message field {name!r} is missing or not " f"{kind.__name__}"
      )
  if not all(isinstance(x, np.ndarray) for x in fields["arrays"].values()):
    raise SyncError(
        "sync message field 'arrays' holds values that are not " "arrays"
    )
  if not all(
      isinstance(v, int) and not isinstance(v, bool)
      for v in fields["checksums"].values()
  ):
    raise SyncError(
        "sync message field 'checksums' holds values that are " "not integers"
    )
  return SyncMessage(
      sequence=fields["sequence"],
      version=fields["version"],
      signature=fields["signature"],
      full=fields["full"],
      merge_step=fields["merge_step"],
      arrays=fields["arrays"],
      checksums={n: int(v) for n, v in fields["checksums"].items()},
  )
