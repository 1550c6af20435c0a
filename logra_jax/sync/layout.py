"""The layout of a synced policy state: its arrays by name and kind
(:func:`named_arrays`) and the digest two ends of sync compare
(:func:`signature`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import policy_state
from logra_jax.optim import factored as factored_lib
from logra_jax.optim import lora as lora_lib
from logra_jax.sync.messages import ADAPTER
from logra_jax.sync.messages import BASE
from logra_jax.sync.messages import COORDS
from logra_jax.sync.messages import DENSE
from logra_jax.sync.messages import FROZEN
from logra_jax.sync.messages import PROJECTOR
from logra_jax.sync.messages import SCALE


def named_arrays(
    state: dict[str, Any], frozen: tuple[str, ...] = ()
) -> dict[str, tuple[str, Any]]:
  """``{name: (kind, array)}`` of a :func:`~logra_jax.policy_state.synced_state`.

  Names are the leaves' key paths (``jax.tree_util.keystr``) with the part of
  a factored weight appended (``.base``, ``.coords``, ``.scale``) or of a
  LoRA weight (``.base``, ``.down``, ``.up``); a projector's name is its
  weight's, prefixed ``projector:``. Kinds: ``"base"``, ``"coords"``,
  ``"scale"``, ``"projector"``, ``"dense"``, ``"adapter"`` and, beside
  adapters, ``"frozen"`` (every other leaf), as are the leaves under the
  top-level names ``frozen`` (``policy_state.frozen_keys``).
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
      out[name] = (FROZEN if _top(path) in frozen else other, w)
      continue
    out[f"{name}.base"] = (BASE, w.base)
    out[f"{name}.coords"] = (COORDS, w.coords)
    if w.scale is not None:
      out[f"{name}.scale"] = (SCALE, w.scale)
    out[f"projector:{name}"] = (PROJECTOR, p)
  return out


def _top(path) -> Any:
  """The top-level name of a key path."""
  return getattr(path[0], "key", None)


def signature(
    state: dict[str, Any], frozen: tuple[str, ...] = (), **fields: Any
) -> str:
  """A digest of the layout of ``state`` (every array's name, kind, shape
  and dtype, with the weights under ``frozen`` frozen) and of ``fields``
  (e.g. the model config, the optimizer's rank and projector kind): two
  policies with the same signature can sync."""
  layout = [
      (name, kind, list(np.shape(x)), str(jnp.result_type(x)))
      for name, (kind, x) in sorted(named_arrays(state, frozen).items())
  ]
  text = json.dumps(
      {"layout": layout, "fields": fields}, sort_keys=True, default=str
  )
  return hashlib.sha256(text.encode()).hexdigest()[:32]
