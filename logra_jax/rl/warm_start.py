"""Supervised warm start of the tiny default policy, cached as an HF folder.

RL needs a policy that is sometimes right. For the tiny default, a small
decoder (our own model class) is trained on the task's worked answers
(``"12+7-3=16"``) with a character tokenizer, saved with ``save_pretrained``
next to its ``tokenizer.json`` and reused by later runs with the same settings.

A cache entry is built in a temporary folder beside it and renamed into place
once complete, so an interrupted run leaves nothing that looks usable; an entry
that is invalid anyway (a missing or unreadable file) is set aside and rebuilt,
and when two runs build the same entry at once, the first to finish wins.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors

from logra_jax import models
from logra_jax.configs import PolicyConfig
from logra_jax.data.batching import encode_sft
from logra_jax.data.tokenizer import char_tokenizer

_FILES = ("config.json", "model.safetensors", "tokenizer.json")


# The context length of a warm-started policy (prompt and completion).
CONTEXT_TOKENS = 64


def tiny_decoder_config(
    policy: PolicyConfig, tokenizer, max_length: int
) -> models.DecoderConfig:
  """The decoder of the tiny default for a tokenizer and context length."""
  return models.DecoderConfig(
      vocab_size=len(tokenizer),
      hidden_size=policy.hidden_size,
      intermediate_size=policy.intermediate_size,
      num_layers=policy.num_layers,
      num_heads=policy.num_heads,
      num_kv_heads=policy.num_kv_heads,
      head_dim=policy.hidden_size // policy.num_heads,
      max_position_embeddings=max_length,
      initializer_range=0.05,
      bos_token_id=tokenizer.bos_token_id,
      eos_token_ids=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id,
      param_dtype=policy.dtype,
  )


def cache_folder(
    policy: PolicyConfig, examples: Sequence[dict], seed: int
) -> pathlib.Path:
  """The cache folder of a warm start: a hash of everything it depends on
  (not of the policy fields that only shape training: attention, remat and
  the reference's dtype)."""
  fields = dataclasses.asdict(policy)
  for name in ("cache_dir", "attention", "remat", "reference_dtype"):
    fields.pop(name)
  blob = json.dumps(
      {
          "policy": fields,
          "seed": seed,
          "data": [e["prompt"] + e["answer"] for e in examples],
      },
      sort_keys=True,
  )
  digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
  return pathlib.Path(os.path.expanduser(policy.cache_dir)) / digest


def entry_problem(folder: pathlib.Path) -> str | None:
  """Why a cache entry is unusable (a missing or unreadable file), or None.

  Example:
    >>> entry_problem(pathlib.Path("/nonexistent"))
    "missing ['config.json', 'model.safetensors', 'tokenizer.json']"
  """
  missing = [f for f in _FILES if not (folder / f).is_file()]
  if missing:
    return f"missing {missing}"
  for name in ("config.json", "tokenizer.json"):
    try:
      json.loads((folder / name).read_text())
    except (OSError, ValueError) as e:
      return f"{name} is not readable JSON ({e})"
  try:
    with safetensors.safe_open(
        str(folder / "model.safetensors"), framework="np"
    ) as f:
      f.keys()
  except Exception as e:  # noqa: BLE001 -- safetensors has its own error type.
    return f"model.safetensors: {e}"
  return None


def _set_aside(folder: pathlib.Path) -> None:
  """Removes a cache entry by renaming it away first, so that no run ever
  sees it half deleted."""
  trash = tempfile.mkdtemp(prefix=f".{folder.name}.invalid-", dir=folder.parent)
  try:
    os.rename(folder, pathlib.Path(trash) / folder.name)
  except FileNotFoundError:
    pass  # another run set it aside first
  finally:
    shutil.rmtree(trash, ignore_errors=True)


def _publish(
    staged: pathlib.Path, folder: pathlib.Path, log: Callable[[str], None]
) -> None:
  """Renames the complete entry ``staged`` to ``folder``, unless another run
  published a valid one first (then that one is kept)."""
  try:
    os.rename(staged, folder)
    return
  except OSError as e:
    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
      raise
  problem = entry_problem(folder)
  if problem is None:
    log(f"warm start: another run published {folder} first; using it")
    return
  log(
      f"warm start: replacing the invalid {folder} another run published "
      f"({problem})"
  )
  _set_aside(folder)
  os.rename(staged, folder)


def warm_start(
    policy: PolicyConfig,
    examples: Sequence[dict],
    seed: int = 0,
    max_length: int = CONTEXT_TOKENS,
    log=print,
) -> pathlib.Path:
  """Trains (or reuses) the tiny policy on worked answers; returns its folder.

  Args:
    policy: sizes and supervised-training settings.
    examples: training examples with ``prompt`` and ``answer``.
    seed: initialization and batching seed.
    max_length: context length of the decoder.
    log: where progress lines go.

  Returns:
    A Hugging Face folder with ``config.json``, ``model.safetensors`` and
    ``tokenizer.json``: a valid cached one (an invalid one is rebuilt,
    saying why), else one trained now and published atomically.
  """
  folder = cache_folder(policy, examples, seed)
  if folder.exists():
    problem = entry_problem(folder)
    if problem is None:
      log(f"warm start: reusing {folder}")
      return folder
    log(f"warm start: rebuilding the invalid {folder} ({problem})")
    _set_aside(folder)
  tokenizer = char_tokenizer()
  config = tiny_decoder_config(policy, tokenizer, max_length)
  model = models.init_model(config, rngs=seed)
  graphdef, params = models.split_model(model)
  texts = [(e["prompt"], e["answer"]) for e in examples]
  batch = encode_sft(tokenizer, [p for p, _ in texts], [a for _, a in texts])
  tokens_NxT = jnp.asarray(batch.tokens_BxT)
  loss_mask_NxT = jnp.asarray(batch.loss_mask_BxT, jnp.float32)
  warmup = max(1, policy.warm_start_steps // 10)
  tx = optax.adamw(
      optax.warmup_cosine_decay_schedule(
          0.0,
          policy.warm_start_lr,
          warmup,
          max(warmup + 1, policy.warm_start_steps),
      ),
      weight_decay=0.01,
  )
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def sft_step(params, opt_state, index_B):
    tokens_BxT, target_mask_BxT = tokens_NxT[index_B], loss_mask_NxT[index_B]

    def loss_fn(params):
      logits_BxTxV = models.logits_fn(graphdef, params, tokens_BxT[:, :-1])
      logp_BxTxV = jax.nn.log_softmax(logits_BxTxV)
      target_logp_BxT = jnp.take_along_axis(
          logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1
      )[..., 0]
      mask_BxT = target_mask_BxT[:, 1:]
      return -jnp.sum(target_logp_BxT * mask_BxT) / jnp.maximum(
          mask_BxT.sum(), 1.0
      )

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  loss = float("nan")
  for step in range(policy.warm_start_steps):
    index = rng.integers(0, len(texts), policy.warm_start_batch)
    params, opt_state, loss = sft_step(params, opt_state, jnp.asarray(index))
    if (step + 1) % max(1, policy.warm_start_steps // 4) == 0:
      log(
          f"warm start: step {step + 1}/{policy.warm_start_steps} "
          f"loss {float(loss):.4f}"
      )
  folder.parent.mkdir(parents=True, exist_ok=True)
  partial = pathlib.Path(
      tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent)
  )
  try:
    staged = partial / folder.name
    models.save_pretrained(nnx.merge(graphdef, params), staged)
    tokenizer.save_pretrained(staged)
    _publish(staged, folder, log)
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  return folder
