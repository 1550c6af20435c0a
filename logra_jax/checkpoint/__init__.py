"""Save and restore the whole state of an RL run with Orbax.

A checkpoint of step ``s`` holds the state after ``s`` learner steps, in
``<run>/checkpoints/<s>/``, as five Orbax items:

=============  ===============================================================
``params``     the policy parameters (an ``nnx.State``)
``opt_state``  the optimizer state: projectors, moments, counts, predicted-KL
               and skipped-step counters
``ref_params`` the reference policy's parameters, when the run holds one
``loop``       JSON: the step, the PRNG key, the data position, the per-step
               metrics history and the summary values so far
``meta``       JSON: format version, run config, model config (HF
               ``config.json``), mesh, process count and the tokenizer files
=============  ===============================================================

so a checkpoint alone is enough to resume a run bit for bit and to export
its policy (:func:`export_policy`). Its parts:

- :mod:`~logra_jax.checkpoint.store`: the :class:`Checkpointer` (atomic,
  possibly asynchronous saves; restores checked before any array is read;
  damaged steps set aside) and :func:`locate`;
- :mod:`~logra_jax.checkpoint.resume`: the run's description
  (:func:`run_meta`) and whether a run may resume it
  (:func:`check_resumable`, :data:`RESUMABLE_FIELDS`);
- :mod:`~logra_jax.checkpoint.items`: what the items hold (:class:`LoopState`,
  :class:`Restored`) and the restore targets (:func:`abstract_state`);
- :mod:`~logra_jax.checkpoint.integrity`: the checksums in ``meta`` and the
  checks that name a damaged array or item;
- :mod:`~logra_jax.checkpoint.export`: the policy as a Hugging Face folder;
- :mod:`~logra_jax.checkpoint.folders`: a run's lock and the folders
  ``--overwrite`` may replace;
- :mod:`~logra_jax.checkpoint.loops`: event loops that let a failed save's
  or restore's other operations finish before they close.

Example:
  >>> from logra_jax import checkpoint, configs
  >>> saved = checkpoint.run_meta(
  ...     configs.TrainConfig(steps=100), {"hidden_size": 64})
  >>> longer = checkpoint.run_meta(
  ...     configs.TrainConfig(steps=500), {"hidden_size": 64})
  >>> checkpoint.config_changes(saved["config"], longer["config"])
  [('steps', 100, 500)]
  >>> checkpoint.check_resumable(saved, longer)  # allowed: nothing raised
"""

from logra_jax.checkpoint.errors import CheckpointError, CorruptCheckpointError
from logra_jax.checkpoint.export import export_policy
from logra_jax.checkpoint.items import LoopState, Restored, abstract_state
from logra_jax.checkpoint.resume import (
    FORMAT_VERSION,
    RESUMABLE_FIELDS,
    check_resumable,
    check_resumable_config,
    config_changes,
    run_meta,
)
from logra_jax.checkpoint.store import BEST_METRIC, Checkpointer, locate
from logra_jax.checkpoint.store import CheckpointSaveError

__all__ = [
    "BEST_METRIC",
    "FORMAT_VERSION",
    "RESUMABLE_FIELDS",
    "CheckpointError",
    "CheckpointSaveError",
    "Checkpointer",
    "CorruptCheckpointError",
    "LoopState",
    "Restored",
    "abstract_state",
    "check_resumable",
    "check_resumable_config",
    "config_changes",
    "export_policy",
    "locate",
    "run_meta",
]
