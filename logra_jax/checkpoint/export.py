"""A checkpoint's policy as a Hugging Face folder (``logra export``)."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import tempfile
from typing import Any, Optional

from flax import nnx
import jax
import transformers

from logra_jax import models
from logra_jax import policy_state
from logra_jax.checkpoint import folders
from logra_jax.checkpoint.items import abstract_state
from logra_jax.checkpoint.store import Checkpointer, locate
from logra_jax.configs import OptimizerConfig
from logra_jax.staging import staged_folder


def _check_out(out: pathlib.Path, source: pathlib.Path, overwrite: bool):
  """Raises FileExistsError unless ``out`` may be written: it does not
  exist, or ``overwrite`` and it is an earlier export's folder
  (:func:`~logra_jax.checkpoint.folders.check_replaceable`); never the
  checkpoints ``source`` or a folder in them."""
  if out.exists() and not out.is_dir():
    raise FileExistsError(
        f"{out} is a file, not a folder: export writes a "
        "Hugging Face folder; choose another --out"
    )
  if source.resolve() in out.resolve().parents:
    raise FileExistsError(
        f"{out} lies in the checkpoints being exported ({source}); choose "
        "another --out"
    )
  if out.exists() and not overwrite:
    raise FileExistsError(
        f"{out} exists; pass overwrite=True (--overwrite) " "to replace it"
    )
  if out.exists():
    folders.check_replaceable(out, source)


def _decoder_config(meta: dict[str, Any]) -> models.DecoderConfig:
  """The decoder a checkpoint's :func:`~logra_jax.checkpoint.run_meta`
  describes, in the run's policy dtype."""
  dtype = meta["config"]["policy"]["dtype"]
  with tempfile.TemporaryDirectory() as tmp:
    (pathlib.Path(tmp) / "config.json").write_text(json.dumps(meta["model"]))
    hf_config = transformers.AutoConfig.from_pretrained(tmp)
  return models.DecoderConfig.from_hf(hf_config, param_dtype=dtype, dtype=dtype)


def _restore_policy(
    ckpt: Checkpointer, step: Optional[int], meta: dict[str, Any]
) -> nnx.Module:
  """The decoder of checkpoint ``step`` with its dense weights, on one
  device."""
  config = _decoder_config(meta)
  abstract = nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract, nnx.Param)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  optimizer = OptimizerConfig(**meta["config"]["optimizer"])
  tx = policy_state.make_optimizer(optimizer, abstract_params)
  restored = ckpt.restore(
      step,
      params=abstract_state(
          policy_state.abstract_weights(optimizer, tx, abstract_params), one
      ),
      opt_state=abstract_state(
          policy_state.abstract_opt_state(optimizer, tx, abstract_params), one
      ),
  )
  # A factored policy is written as its weights W = c B + P A, a LoRA one
  # as W_0 + s D U.
  params = policy_state.dense_weights(restored.params, restored.opt_state)
  # In the policy's dtype throughout (frozen weights may be held narrower).
  params = jax.tree.map(lambda p, a: p.astype(a.dtype), params, abstract_params)
  return nnx.merge(graphdef, params)


def export_policy(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: Optional[int] = None,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes a checkpoint's policy as a Hugging Face folder.

  ``config.json`` and safetensors (``models.save_pretrained``) plus the
  tokenizer files stored in the checkpoint, and ``logra_export.json``
  (:data:`~logra_jax.checkpoint.folders.EXPORT_MARKER`: the checkpoints
  exported and the files written); ``transformers`` loads the folder with
  ``AutoModelForCausalLM`` and ``AutoTokenizer``. The folder is assembled
  next to ``out`` and renamed into place when complete
  (:func:`logra_jax.staging.staged_folder`). ``overwrite`` replaces only an
  earlier export's folder that holds nothing else: never the run exported,
  a folder in its checkpoints, a run folder or a live run's.

  Args:
    checkpoint: a run folder, its ``checkpoints`` folder or one step in it.
    out: the HF folder to write.
    step: which checkpoint (default: the one ``checkpoint`` names, else the
      latest).
    overwrite: replace an existing ``out`` that an export wrote.

  Returns:
    ``out``.

  Raises:
    CheckpointError: no (readable) checkpoint.
    CorruptCheckpointError: the checkpoint's policy does not match its
      checksums (nothing is written).
    FileExistsError: ``out`` is a file, exists and ``overwrite`` is
      False, or is no export's folder to replace (naming why).

  Example:
    >>> export_policy("runs/tiny-20250101-000000", "exported")  # doctest: +SKIP
  """
  directory, named_step = locate(checkpoint)
  step = step if step is not None else named_step
  out = pathlib.Path(out).absolute()
  _check_out(out, directory, overwrite)
  with Checkpointer(directory, read_only=True) as ckpt:
    meta = ckpt.read_meta(step)
    policy = _restore_policy(ckpt, step, meta)
  with staged_folder(out) as folder:
    models.save_pretrained(policy, folder)
    for name, data in meta.get("tokenizer", {}).items():
      (folder / name).write_bytes(base64.b64decode(data))
    folders.write_marker(folder, directory)
  return out
