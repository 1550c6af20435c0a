"""What the learner did since the last sync message, from its optimizer's
counters: how many updates it attempted, counted, skipped and quantized
(:class:`UpdateCounts`, read together once per message), and which window
merges it made (:func:`merges_since`)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import optax

from logra_jax.optim import step_codes
from logra_jax.optim.non_finite import non_finite_state
from logra_jax.optim.types import ProjectState


class UpdateCounts(NamedTuple):
  """The optimizer's counters a message follows, read from the device
  together, once per message (None where the chain has no such stage): the
  ``project`` stage's count, the updates ``skip_non_finite`` saw and those
  it skipped, and ``quantize_steps``' count."""

  projected: Optional[int]
  attempted: Optional[int]
  skipped: Optional[int]
  quantized: Optional[int]


def read_counts(
    opt_state: optax.OptState, project: Optional[ProjectState]
) -> UpdateCounts:
  """The :class:`UpdateCounts` of ``opt_state`` (whose ``project`` stage
  is ``project``), in one transfer from the device."""
  skips = non_finite_state(opt_state)
  quantize = step_codes.quantize_state(opt_state)
  fields = (
      (project, "count"),
      (skips, "count"),
      (skips, "skipped_steps"),
      (quantize, "count"),
  )
  values = jax.device_get(
      [
          None if state is None else getattr(state, name)
          for state, name in fields
      ]
  )
  return UpdateCounts(*(None if v is None else int(v) for v in values))


def merges_between(
    state: Optional[ProjectState], count: Optional[int], since: Optional[int]
) -> list[int]:
  """The steps of the merges the updates since the ``project`` stage's count
  ``since`` were preceded by (None: the last update's), the stage being at
  ``count`` now: the learner merges (``factored.merge_at_refresh``) when the
  count is a multiple of ``refresh_every``, then counts the update."""
  if state is None:
    return []
  first = count - 1 if since is None else since
  every = state.spec.config.refresh_every
  return [m for m in range(max(first, 0), count) if m % every == 0]


def merges_since(
    project: Optional[ProjectState],
    counts: UpdateCounts,
    last: Optional[UpdateCounts],
) -> Optional[list[int]]:
  """The steps of the merges the learner made since the message whose
  counters were ``last`` (:func:`merges_between`), or None when they cannot be
  told: the learner merges at the start of every update it attempts at a
  refresh count, also of one ``skip_non_finite`` then skips before the
  ``project`` stage counts it (a non-finite loss or gradient). One such
  update alone merged at the count the stage still holds; among several,
  which ones merged is not known (the message is then full)."""
  since = None if last is None else last.projected
  merges = merges_between(project, counts.projected, since)
  if None in (project, counts.attempted, since) or last.attempted is None:
    return merges
  attempted = counts.attempted - last.attempted
  counted = counts.projected - since
  if attempted == counted:
    return merges
  if (attempted, counted) == (1, 0):
    every = project.spec.config.refresh_every
    return [] if counts.projected % every else [counts.projected]
  return None
