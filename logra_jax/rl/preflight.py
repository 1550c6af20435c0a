"""Checks of a run's inputs that need the policy's shapes or its tokenizer,
made before the run writes anything, trains a warm start or compiles.

The policy's parameters are known here as shapes only (``jax.eval_shape``
of the decoder its ``config.json``, or the warm start's settings, describe),
so the checks cost a trace, not a load: the optimizer's plan over them (a
rank larger than every matrix it projects, LoRA targets and ranks), the
warm start's cache folder, the prompts against the chat template and the
context, and a resumed run's config against its checkpoint's.
"""

from __future__ import annotations

import pathlib
import re
import tempfile
from typing import Any, Sequence

import jax

from logra_jax import checkpoint
from logra_jax import models
from logra_jax import policy_state
from logra_jax.configs import TrainConfig
from logra_jax.data import tasks as tasks_lib
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.optim import dimension_numbers
from logra_jax.rl import warm_start
from logra_jax.rollout import engine as engine_lib

# How many of the task's prompts (the longest in characters) are encoded to
# check them against the context before the run starts.
LONGEST_PROMPTS = 256


def policy_tokenizer(config: TrainConfig) -> Any:
  """The tokenizer of the run's policy: ``policy.path``'s, or the warm
  start's character tokenizer."""
  if config.policy.path:
    return models.load_tokenizer(pathlib.Path(config.policy.path).expanduser())
  return char_tokenizer()


def decoder_config(config: TrainConfig, tokenizer: Any) -> models.DecoderConfig:
  """The decoder of the run's policy, from ``policy.path``'s config.json or
  the warm start's settings (nothing read but config files)."""
  if config.policy.path:
    return models.read_decoder_config(
        pathlib.Path(config.policy.path).expanduser(),
        param_dtype=config.policy.dtype,
        dtype=config.policy.dtype,
    )
  return warm_start.tiny_decoder_config(
      config.policy,
      tokenizer,
      warm_start.context_tokens(config.task.environment),
  )


def abstract_params(decoder: models.DecoderConfig) -> Any:
  """The decoder's parameters as shapes and dtypes (no array allocated)."""
  return jax.eval_shape(
      lambda: models.split_model(models.init_model(decoder, rngs=0))[1]
  )


def check_optimizer_plan(config: TrainConfig, params: Any) -> None:
  """Refuses an optimizer that cannot act on ``params`` (shapes): a low-rank
  rank larger than every matrix it would project (every one would be kept
  dense: dense Adam under another name), and whatever
  :func:`policy_state.init_train_state` refuses (LoRA targets that name no
  parameter, a LoRA rank above a matrix's side), by tracing it."""
  optimizer = config.optimizer
  if optimizer.name in ("logra", "galore"):
    dims = policy_state.matrix_dimension_numbers(
        params, include_embeddings=optimizer.project_embeddings
    )
    plans = jax.tree.leaves(
        dimension_numbers.plan_leaves(params, optimizer.rank, dims, None),
        is_leaf=lambda x: isinstance(x, dimension_numbers.LeafPlan),
    )
    matrices = [p for p in plans if p.m]
    if matrices and all(p.kept_dense for p in matrices):
      largest = max(matrices, key=lambda p: max(p.m, p.n))
      name = "/".join(re.findall(r"\['(\w+)'\]", largest.path))
      raise ValueError(
          f"optimizer.rank={optimizer.rank} is larger than every matrix "
          f"{optimizer.name} projects (the largest, {name}, is "
          f"{largest.m} x {largest.n}): every one would stay dense; choose "
          f"optimizer.rank <= {max(largest.m, largest.n)}"
      )
  tx = policy_state.make_optimizer(optimizer, params)
  try:
    jax.eval_shape(
        lambda p: policy_state.init_train_state(optimizer, tx, p, config.seed),
        params,
    )
  except ValueError as error:
    if optimizer.name != "lora":
      raise
    raise ValueError(
        f"optimizer.lora_targets={list(optimizer.lora_targets)} with "
        f"optimizer.rank={optimizer.rank}: {error}"
    ) from None


def check_cache_dir(config: TrainConfig) -> None:
  """Refuses a ``policy.cache_dir`` the warm start cannot write to (only
  when it is used: no ``policy.path``)."""
  if config.policy.path:
    return
  folder = pathlib.Path(config.policy.cache_dir).expanduser()
  try:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
      pass
  except OSError as error:
    raise ValueError(
        f"policy.cache_dir={config.policy.cache_dir!r} is not a folder the "
        f"warm start can write to: {error.strerror or error}"
    ) from None


def check_prompts(
    config: TrainConfig,
    tokenizer: Any,
    decoder: models.DecoderConfig,
    examples: Sequence[dict],
) -> None:
  """Refuses ``task.system_prompt`` without a chat template, and prompts
  that leave no room in the context for ``rollout.max_new_tokens``: the
  :data:`LONGEST_PROMPTS` prompts longest in characters are encoded as the
  policy will see them (the sampler checks every batch exactly again)."""
  where = config.policy.path or "the warm-started policy"
  chat = engine_lib.uses_chat_template(
      tokenizer, config.task.chat_template, config.task.system_prompt, where
  )
  prompts = sorted({e["prompt"] for e in examples}, key=len, reverse=True)
  lengths = engine_lib.encode_prompts(
      tokenizer, prompts[:LONGEST_PROMPTS], chat, config.task.system_prompt
  )
  longest = max((len(ids) for ids in lengths), default=0)
  context = decoder.max_position_embeddings
  budget = config.rollout.max_new_tokens
  if longest + budget > context:
    raise ValueError(
        f"the task's longest prompt is {longest} tokens; with "
        f"rollout.max_new_tokens={budget} it does not fit the context of "
        f"{context} tokens of {where}: lower rollout.max_new_tokens to at "
        f"most {max(context - longest, 0)} or shorten the prompts"
    )


def check_resume(config: TrainConfig, out: pathlib.Path) -> None:
  """Refuses to resume a run whose newest checkpoint was written with a
  config that differs outside ``checkpoint.RESUMABLE_FIELDS``: at once,
  before the policy is loaded or warm-started. (An unreadable newest
  checkpoint is left to the restore, which falls back to an older one.)"""
  checkpointer = checkpoint.Checkpointer(out / "checkpoints", config.checkpoint)
  try:
    if checkpointer.latest_step() is None:
      return
    saved = checkpointer.read_meta()
  except checkpoint.CorruptCheckpointError:
    return
  finally:
    checkpointer.close()
  checkpoint.check_resumable_config(saved, config)


def check_policy_inputs(
    config: TrainConfig,
    task: tasks_lib.Task,
    out: pathlib.Path,
    resume: bool,
) -> None:
  """Every check of this module, in the order of their cost."""
  if resume:
    check_resume(config, out)
  check_cache_dir(config)
  tokenizer = policy_tokenizer(config)
  decoder = decoder_config(config, tokenizer)
  check_optimizer_plan(config, abstract_params(decoder))
  check_prompts(config, tokenizer, decoder, task.examples)
