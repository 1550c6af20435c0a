"""Checks that a checkpoint reads back what was written.

``meta`` holds the checksums of everything else: one per array
(``checksums.array_checksums``, computed where the arrays live, so the same
for any mesh or number of processes) and one of ``loop``; and a checksum of
itself (``digest``). Reading recomputes them and raises
:class:`~logra_jax.checkpoint.CorruptCheckpointError` naming the damaged
array or item; arrays are compared by name, shape and dtype with the
restore target before any is read.
"""

from __future__ import annotations

import json
import pathlib
import zlib
from typing import Any

import jax
import numpy as np

from logra_jax import checksums
from logra_jax.checkpoint.errors import CheckpointError, CorruptCheckpointError
from logra_jax.checkpoint.items import ARRAY_ITEMS
from logra_jax.checkpoint.resume import FORMAT_VERSION


def json_checksum(value: Any) -> str:
  """CRC-32 of ``value`` as canonical JSON.

  Example:
    >>> json_checksum({"b": 1, "a": [2]}) == json_checksum({"a": [2], "b": 1})
    True
  """
  return f"{zlib.crc32(json.dumps(value, sort_keys=True).encode()):08x}"


def _without_digest(meta: dict[str, Any]) -> dict[str, Any]:
  """``meta`` less its own checksum."""
  return {k: v for k, v in meta.items() if k != "digest"}


def sealed_meta(
    meta: dict[str, Any], trees: dict[str, Any], loop_json: dict[str, Any]
) -> dict[str, Any]:
  """``meta`` with the checksums of the array items ``trees`` and of the
  loop state ``loop_json``, and a checksum of itself (``digest``).

  Example:
    >>> import jax.numpy as jnp
    >>> meta = sealed_meta({"format": 3}, {"params": [jnp.zeros(2)]}, {})
    >>> sorted(meta), sorted(meta["checksums"])
    (['checksums', 'digest', 'format'], ['loop', 'params'])
  """
  written = {k: checksums.array_checksums(v) for k, v in trees.items()}
  written["loop"] = json_checksum(loop_json)
  sealed = dict(_without_digest(meta), checksums=written)
  sealed["digest"] = json_checksum(sealed)
  return sealed


def check_meta(meta: Any, path: pathlib.Path) -> None:
  """Raises unless ``meta``, read from checkpoint ``path``, is a run
  description of this format that matches its checksum.

  Raises:
    CorruptCheckpointError: not a description, or not matching its checksum.
    CheckpointError: written in another format (by another version).
  """
  if not isinstance(meta, dict) or "format" not in meta:
    raise CorruptCheckpointError(
        f"checkpoint {path}: meta is not a " "logra-jax run description"
    )
  digest = meta.get("digest")
  if digest is not None and digest != json_checksum(_without_digest(meta)):
    raise CorruptCheckpointError(
        f"checkpoint {path}: its description (meta) does not match its "
        "checksum: damaged after the save"
    )
  if meta["format"] != FORMAT_VERSION:
    raise CheckpointError(
        f"checkpoint {path} has format {meta['format']!r}; this version of "
        f"logra-jax reads format {FORMAT_VERSION}"
    )
  if digest is None:
    raise CorruptCheckpointError(
        f"checkpoint {path}: its description " "(meta) has no checksum"
    )


def check_shapes(
    path: pathlib.Path, name: str, saved_tree: Any, target: Any
) -> None:
  """Compares the saved arrays of item ``name`` (Orbax's metadata tree)
  with ``target`` by name, shape and dtype, before any of them is read.

  Raises:
    CorruptCheckpointError: no metadata (the item is missing).
    CheckpointError: naming up to five arrays that differ.
  """
  if saved_tree is None:
    raise CorruptCheckpointError(f"checkpoint {path} is missing")
  saved = {
      m.name: m for m in jax.tree.leaves(saved_tree) if hasattr(m, "shape")
  }
  wanted = {
      checksums.array_name(key_path): leaf
      for key_path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]
  }
  problems = [
      f"{k} is missing from the checkpoint" for k in wanted if k not in saved
  ]
  problems += [
      f"{k} is in the checkpoint but not in this run"
      for k in saved
      if k not in wanted
  ]
  for k in wanted.keys() & saved.keys():
    a, b = saved[k], wanted[k]
    if tuple(a.shape) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(
        b.dtype
    ):
      problems.append(
          f"{k} is {np.dtype(a.dtype).name}{list(a.shape)} in "
          f"the checkpoint but {np.dtype(b.dtype).name}"
          f"{list(b.shape)} in this run"
      )
  if problems:
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    raise CheckpointError(
        f"checkpoint {path} does not match this run's {name}: "
        + "; ".join(sorted(problems)[:5])
        + more
    )


def verify(where: str, written: dict[str, Any], restored: Any) -> None:
  """Compares the items read from a checkpoint (``where`` names it) with
  the checksums ``written`` with them.

  Raises:
    CorruptCheckpointError: naming the first item or array that differs.
  """
  if json_checksum(restored.loop) != written.get("loop"):
    raise CorruptCheckpointError(
        f"{where}: loop (step, PRNG key, data position, history) does not "
        "match its checksum: damaged after the save"
    )
  for item in ARRAY_ITEMS:
    if item not in restored.keys():
      continue
    item_written = written.get(item, {})
    for name, value in checksums.array_checksums(restored[item]).items():
      if item_written.get(name) != value:
        raise CorruptCheckpointError(
            f"{where}: array {item}.{name} does not match its checksum "
            f"(written {item_written.get(name)}, read {value}): damaged "
            "after the save"
        )
