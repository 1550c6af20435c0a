"""The two ends of policy sync: :class:`PolicySender` (the learner's) and
:class:`PolicyReceiver` (a copy of the policy, moved only to verified
states), with the layout they share (:func:`named_arrays`,
:func:`signature`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Callable, Optional

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
from logra_jax.sync.messages import ADAPTER
from logra_jax.sync.messages import BASE
from logra_jax.sync.messages import COORDS
from logra_jax.sync.messages import DENSE
from logra_jax.sync.messages import EVERY_STEP
from logra_jax.sync.messages import FROZEN
from logra_jax.sync.messages import PROJECTOR
from logra_jax.sync.messages import SCALE
from logra_jax.sync.messages import SyncError
from logra_jax.sync.messages import SyncMessage


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
    if not _random_kind(project):
      return policy_state.synced_state(weights, opt_state)
    window = max(int(project.count) - 1, 0) // project.spec.config.refresh_every
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
    regenerated = _random_kind(project)
    sent = lambda kind: (
        full
        or kind in EVERY_STEP
        or (kind == PROJECTOR and merge_step >= 0 and not regenerated)
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
        window=self._window[0] if regenerated else -1,
        arrays={n: x for n, (kind, x) in named.items() if sent(kind)},
        checksums=_checksums({n: x for n, (_, x) in named.items()}),
    )


def projectors_travel(kind: str) -> bool:
  """Whether a refresh's message carries the new window's projectors: for
  every projector kind but ``"random"``, whose projectors the receiver
  regenerates from the seed."""
  return kind != "random"


def _random_kind(project: Optional[ProjectState]) -> bool:
  """Whether the projectors are regenerated by the receiver."""
  return project is not None and not projectors_travel(project.spec.config.kind)


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
    projectors: for ``kind="random"`` projectors, window -> the window's
      projectors (:func:`~logra_jax.policy_state.projector_source`), so
      that a refresh's message need not carry them; without it such a
      message is refused (and a full one, which carries them, heals it).
    **fields: as given to the sender (model config, rank, ...).

  Attributes:
    state: the :func:`~logra_jax.policy_state.synced_state` held (``template`` until the first full
      message).
    signature: the layout it accepts.
    sequence, version: of the last message applied (-1 before the first).
  """

  def __init__(
      self,
      template: dict[str, Any],
      *,
      seed: int,
      projectors: Optional[Callable[[int], Any]] = None,
      **fields: Any,
  ):
    self.state = template
    self.signature = signature(template, seed=seed, **fields)
    self.seed = seed
    self._projectors = projectors
    self._window = -1  # the window of the random projectors held
    self.sequence = -1
    self.version = -1

  def apply(self, message: SyncMessage) -> None:
    """Verifies ``message`` and moves the weights to it.

    Raises:
      SyncError: the message is for another layout or configuration, out of
        order, older than the weights held, names steps or projector windows
        that cannot follow the ones held, has missing or misshapen arrays,
        or the result's checksums differ from the learner's; the receiver's
        state is unchanged.
    """
    self._check_header(message)
    named = named_arrays(self.state)
    expected = {
        n
        for n, (kind, _) in named.items()
        if message.full
        or kind in EVERY_STEP
        or (kind == PROJECTOR and message.merge_step >= 0 > message.window)
    }
    missing = sorted(expected - set(message.arrays))
    extra = sorted(set(message.arrays) - expected)
    if missing or extra:
      raise SyncError(
          f"message {message.sequence} does not fit the layout: "
          f"missing {missing[:3]}, unexpected {extra[:3]}"
      )
    state = _replace(self._merged(message), message.arrays)
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
    self._window = message.window

  def _check_header(self, message: SyncMessage) -> None:
    """Refuses (:class:`SyncError`) a message that cannot follow the one
    held, from its fields alone: another signature, out of order, older,
    or a merge step or projector window out of range or out of sequence
    (a step keeps the window, a merge moves it by at most one)."""
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
    for field in ("merge_step", "window"):
      if not -1 <= getattr(message, field) < 2**31:
        raise SyncError(
            f"message {message.sequence}: {field} "
            f"{getattr(message, field)} is neither -1 nor an int32 >= 0"
        )
    moves = (0,) if message.merge_step < 0 else (0, 1)
    if not message.full and message.window - self._window not in moves:
      raise SyncError(
          f"message {message.sequence} names projector window "
          f"{message.window} after window {self._window}"
          + (" without a merge" if message.merge_step < 0 else "")
      )

  def _merged(self, message: SyncMessage) -> dict[str, Any]:
    """The state held, with the message's window merge applied and the
    new window's random projectors regenerated (when it names one)."""
    state = self.state
    if message.full or message.merge_step < 0:
      return state
    weights = _merge(
        state["weights"],
        state["projectors"],
        jnp.asarray(message.merge_step, jnp.int32),
        seed=self.seed,
    )
    if message.window in (-1, self._window):  # the projectors held
      return dict(state, weights=weights)
    if self._projectors is None:
      raise SyncError(
          f"message {message.sequence} leaves window {message.window}'s "
          "random projectors to the receiver, which was given no "
          "projector source to regenerate them (a full message carries "
          "them)"
      )
    placed = lambda new, old: (
        new
        if getattr(old, "sharding", None) is None
        else jax.device_put(new, old.sharding)
    )
    projectors = jax.tree.map(
        placed, self._projectors(message.window), state["projectors"]
    )
    return {"weights": weights, "projectors": projectors}

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
