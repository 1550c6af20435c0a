"""Supervised warm start of the tiny default policy, cached as an HF folder.

RL needs a policy that is sometimes right. For the tiny default, a small
decoder (our own model class) is trained on the task's worked answers
(``"12+7-3=16"``) with a character tokenizer, saved with ``save_pretrained``
next to its ``tokenizer.json`` and reused by later runs with the same settings.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from typing import Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax import models
from logra_jax.configs.train import PolicyConfig
from logra_jax.data.batching import encode_sft
from logra_jax.data.tokenizer import char_tokenizer

_FILES = ("config.json", "tokenizer.json")


def tiny_decoder_config(policy: PolicyConfig, tokenizer,
                        max_length: int) -> models.DecoderConfig:
  """The decoder of the tiny default for a tokenizer and context length."""
  return models.DecoderConfig(
      vocab_size=len(tokenizer), hidden_size=policy.hidden_size,
      intermediate_size=policy.intermediate_size,
      num_layers=policy.num_layers, num_heads=policy.num_heads,
      num_kv_heads=policy.num_kv_heads,
      head_dim=policy.hidden_size // policy.num_heads,
      max_position_embeddings=max_length, initializer_range=0.05,
      bos_token_id=tokenizer.bos_token_id,
      eos_token_ids=(tokenizer.eos_token_id,),
      pad_token_id=tokenizer.pad_token_id, param_dtype=policy.dtype)


def cache_folder(policy: PolicyConfig, examples: Sequence[dict],
                 seed: int) -> pathlib.Path:
  """The cache folder of a warm start: a hash of everything it depends on."""
  fields = dataclasses.asdict(policy)
  fields.pop("cache_dir")
  blob = json.dumps({"policy": fields, "seed": seed,
                     "data": [e["prompt"] + e["answer"] for e in examples]},
                    sort_keys=True)
  digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
  return pathlib.Path(os.path.expanduser(policy.cache_dir)) / digest


def warm_start(policy: PolicyConfig, examples: Sequence[dict], seed: int = 0,
               max_length: int = 64, log=print) -> pathlib.Path:
  """Trains (or reuses) the tiny policy on worked answers; returns its folder.

  Args:
    policy: sizes and supervised-training settings.
    examples: training examples with ``prompt`` and ``answer``.
    seed: initialization and batching seed.
    max_length: context length of the decoder.
    log: where progress lines go.

  Returns:
    A Hugging Face folder with ``config.json``, ``model.safetensors`` and
    ``tokenizer.json``.
  """
  folder = cache_folder(policy, examples, seed)
  if all((folder / f).exists() for f in _FILES):
    log(f"warm start: reusing {folder}")
    return folder
  tokenizer = char_tokenizer()
  config = tiny_decoder_config(policy, tokenizer, max_length)
  model = models.init_model(config, rngs=seed)
  graphdef, params = models.split_model(model)
  texts = [(e["prompt"], e["answer"]) for e in examples]
  batch = encode_sft(tokenizer, [p for p, _ in texts], [a for _, a in texts])
  tokens_NxT = jnp.asarray(batch.tokens_BxT)
  loss_mask_NxT = jnp.asarray(batch.loss_mask_BxT, jnp.float32)
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, policy.warm_start_lr, max(1, policy.warm_start_steps // 10),
      max(1, policy.warm_start_steps)), weight_decay=0.01)
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def sft_step(params, opt_state, index_B):
    tokens_BxT, target_mask_BxT = tokens_NxT[index_B], loss_mask_NxT[index_B]

    def loss_fn(params):
      logits_BxTxV = models.logits_fn(graphdef, params, tokens_BxT[:, :-1])
      logp_BxTxV = jax.nn.log_softmax(logits_BxTxV)
      target_logp_BxT = jnp.take_along_axis(
          logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
      mask_BxT = target_mask_BxT[:, 1:]
      return -jnp.sum(target_logp_BxT * mask_BxT) / jnp.maximum(
          mask_BxT.sum(), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  loss = float("nan")
  for step in range(policy.warm_start_steps):
    index = rng.integers(0, len(texts), policy.warm_start_batch)
    params, opt_state, loss = sft_step(params, opt_state, jnp.asarray(index))
    if (step + 1) % max(1, policy.warm_start_steps // 4) == 0:
      log(f"warm start: step {step + 1}/{policy.warm_start_steps} "
          f"loss {float(loss):.4f}")
  models.save_pretrained(nnx.merge(graphdef, params), folder)
  tokenizer.save_pretrained(folder)
  return folder
