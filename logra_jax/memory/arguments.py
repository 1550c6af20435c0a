"""Checks of the planner's arguments, before anything compiles."""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional

from logra_jax import configs
from logra_jax import models
from logra_jax import parallel

# What the planner lays out: dense AdamW, LoGRA and LoRA (a GaLore run is
# planned as LoGRA with dense gradients).
OPTIMIZERS = ("adam", "logra", "lora")


def run_config(
    opt_config: configs.OptimizerConfig,
    micro_batches: int,
    rows: int,
    mesh: parallel.MeshConfig,
) -> configs.TrainConfig:
  """The run planned: ``opt_config`` and ``micro_batches`` over a batch of
  ``rows`` sequences, whose KL predictor's subsample is checked here."""
  if opt_config.kl_subsample is not None and opt_config.target_kl is None:
    raise ValueError("kl_subsample needs target_kl (KL control)")
  configs.check_kl_subsample(
      opt_config,
      rows,
      mesh.dp * mesh.fsdp,
      batch="the planned batch of {rows} sequences (micro_batch x "
      "micro_batches x the mesh's dp x fsdp)",
  )
  return dataclasses.replace(
      configs.TrainConfig(), optimizer=opt_config, micro_batches=micro_batches
  )


def check(
    optimizer: str,
    remat: str,
    sizes: dict[str, int],
    rollout: tuple[int, int, int],
    reference_dtype: Optional[str],
) -> None:
  """Raises a ValueError naming the first argument out of its range."""
  if optimizer not in OPTIMIZERS:
    raise ValueError(
        f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}"
    )
  if remat not in models.REMAT:
    raise ValueError(f"remat must be one of {models.REMAT}, got {remat!r}")
  for name, value in sizes.items():
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  if sizes["prompt_len"] >= sizes["seq_len"]:
    raise ValueError(
        f"prompt_len must be below seq_len={sizes['seq_len']}, got "
        f"{sizes['prompt_len']}"
    )
  if min(rollout) < 0:
    raise ValueError(
        "rollout_seqs, rollout_tokens and rollout_turn_tokens must be >= 0"
    )
  if rollout[2] and rollout[2] >= rollout[1]:
    raise ValueError(
        f"rollout_turn_tokens must be below rollout_tokens={rollout[1]} (a "
        f"turn follows a prompt), got {rollout[2]}"
    )
  if reference_dtype not in (None, "bfloat16", "float32"):
    raise ValueError(
        f"reference_dtype must be 'bfloat16' or 'float32', got "
        f"{reference_dtype!r}"
    )


# The planner's argument names that ``logra memory``'s flags do not spell.
FLAG_ALIASES = {"seq_len": "seq", "name": "optimizer"}
# A name in a message: ``optimizer.field``, a bare identifier, and ``=``
# when a value follows.
_MESSAGE_NAME = re.compile(r"(?<![\w.-])(optimizer\.)?([a-z][a-z_]*)(=?)")


def as_flags(message: str, flags: Mapping[str, str]) -> str:
  """``message`` with each name that ``flags`` maps (a flag's dest, or an
  alias of :data:`FLAG_ALIASES`) written as its flag, prefixed by
  ``optimizer.`` or not: ``optimizer.freeze_embeddings`` ->
  ``--freeze-embeddings``, ``seq_len=8`` -> ``--seq=8``, ``name='adam'`` ->
  ``--optimizer='adam'``. A bare word is taken for a name only when it has
  an underscore or a value (``rank 8`` in prose stays); other names keep
  their config names.

  Example:
    >>> flags = {"kl_subsample": "--kl-subsample", "target_kl": "--target-kl"}
    >>> as_flags("kl_subsample needs optimizer.target_kl; rank 8", flags)
    '--kl-subsample needs --target-kl; rank 8'
  """

  def flag(match: re.Match) -> str:
    prefixed, name, value = match.groups()
    dest = FLAG_ALIASES.get(name, name)
    if (prefixed or "_" in name or value) and dest in flags:
      return flags[dest] + value
    return match.group(0)

  return _MESSAGE_NAME.sub(flag, message)
