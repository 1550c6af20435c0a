"""Supervised warm start of the tiny default policy, cached as an HF folder.

RL needs a policy that is sometimes right. For the tiny default, a small
decoder (our own model class) is trained on the task's worked answers
(``"12+7-3=16"``) with a character tokenizer, saved with ``save_pretrained``
next to its ``tokenizer.json`` and reused by later runs with the same settings.
With the ``calculator`` environment it is trained on tool-using episodes
instead (:func:`tool_demonstrations`), so that it has seen the tool's format.

A cache entry is built in a staging area beside it (:mod:`logra_jax.staging`)
and renamed into place once complete, so an interrupted run leaves nothing that
looks usable; an entry that is invalid anyway (a missing or unreadable file) is
rebuilt and replaced when the new one is published, and when two runs build the
same entry at once, the first to finish wins (publishing checks and renames
under the lock of the cache folder).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from typing import Callable, Optional, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors

from logra_jax import envs
from logra_jax import models
from logra_jax import staging
from logra_jax.configs import PolicyConfig
from logra_jax.data.batching import encode_sft
from logra_jax.data.tokenizer import char_tokenizer

_FILES = ("config.json", "model.safetensors", "tokenizer.json")


# The context length of a warm-started policy (prompt and completion).
CONTEXT_TOKENS = 64
# The context length of one that plays episodes: the prompt, the model's
# turns and the environment's messages (a calculator episode on 5-digit
# terms is about 80 characters).
EPISODE_CONTEXT_TOKENS = 128
# The environment whose episodes the warm start can demonstrate.
DEMONSTRATED = "calculator"


def context_tokens(environment: str) -> int:
  """The context length of the tiny policy of a run with ``environment``
  (``task.environment``; empty: none).

  Example:
    >>> context_tokens(""), context_tokens("calculator")
    (64, 128)
  """
  return EPISODE_CONTEXT_TOKENS if environment else CONTEXT_TOKENS


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
    policy: PolicyConfig,
    examples: Sequence[dict],
    seed: int,
    environment: str = "",
) -> pathlib.Path:
  """The cache folder of a warm start: a hash of everything it depends on
  (not of the policy fields that only shape training: attention, remat and
  the reference's dtype); the environment and the context length only
  where there is an environment, so that a run without one keeps its
  folder."""
  fields = dataclasses.asdict(policy)
  for name in ("cache_dir", "attention", "remat", "reference_dtype"):
    fields.pop(name)
  key = {
      "policy": fields,
      "seed": seed,
      "data": [e["prompt"] + e["answer"] for e in examples],
  }
  if environment:
    key["max_length"] = context_tokens(environment)
  if environment == DEMONSTRATED:
    key["demonstrations"] = DEMONSTRATED
  blob = json.dumps(key, sort_keys=True)
  digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
  return pathlib.Path(os.path.expanduser(policy.cache_dir)) / digest


def tool_demonstrations(
    examples: Sequence[dict], tokenizer, max_length: int
) -> tuple[np.ndarray, np.ndarray]:
  """Supervised rows of calculator episodes on the tiny task's examples.

  Each example's prompt is an expression and ``=`` (``"1663-5242="``): the
  demonstrated episode calls the tool on it (``<calc>1663-5242</calc>``),
  reads the calculator's answer and writes the answer then the stop token.
  The episode is played against the calculator itself (:func:`envs.
  run_episodes` with the turns scripted), so its tokens are exactly what
  an RL episode holds: the loss mask is 1 on the model's turns and 0 on the
  prompt, the environment's tokens and the padding.

  Args:
    examples: the tiny task's examples (``prompt``, ``answer``).
    tokenizer: the policy's (character) tokenizer.
    max_length: the policy's context; a longer episode is an error.

  Returns:
    ``(tokens_NxT, loss_mask_NxT)``, int32, right-padded.

  Example:
    >>> from logra_jax.data.tokenizer import char_tokenizer
    >>> tokenizer = char_tokenizer()
    >>> tokens, mask = tool_demonstrations(
    ...     [{"prompt": "2*3=", "answer": "6"}], tokenizer, 64)
    >>> tokenizer.decode(tokens[0][mask[0] == 1])
    '<calc>2*3</calc>6<eos>'
    >>> tokenizer.decode(tokens[0][mask[0] == 0], skip_special_tokens=True)
    '2*3=\\n<result>6</result>\\n'
  """
  scripts = [
      [f"<calc>{e['prompt'].removesuffix('=')}</calc>", e["answer"]]
      for e in examples
  ]
  eos = tokenizer.eos_token_id
  width = max(len(t) for script in scripts for t in script) + 1

  def sample_turn(histories, turn):
    tokens_NxT = np.zeros((len(histories), width), np.int32)
    lengths_N = np.zeros(len(histories), np.int32)
    for i, script in enumerate(scripts):
      ids = tokenizer(script[min(turn, 1)], add_special_tokens=False)
      row = ids["input_ids"] + ([eos] if turn else [])
      tokens_NxT[i, : len(row)], lengths_N[i] = row, len(row)
    return tokens_NxT, np.zeros(tokens_NxT.shape, np.float32), lengths_N

  played = envs.run_episodes(
      envs.EpisodeConfig(envs.Calculator, max_turns=2),
      examples,
      envs.Renderer(tokenizer),
      sample_turn,
      stop_ids=[eos],
      context=max_length,
  )
  rows = [e.prompt_ids + envs.episode_sequence(e)[0] for e in played]
  longest = max(map(len, rows))
  if longest > max_length:
    raise ValueError(
        f"a calculator episode of {longest} tokens exceeds the context "
        f"{max_length}"
    )
  tokens_NxT = np.full((len(rows), longest), tokenizer.pad_token_id, np.int32)
  mask_NxT = np.zeros((len(rows), longest), np.int32)
  for r, (episode, row) in enumerate(zip(played, rows)):
    tokens_NxT[r, : len(row)] = row
    mask_NxT[r, len(episode.prompt_ids) : len(row)] = envs.episode_sequence(
        episode
    )[1]
  return tokens_NxT, mask_NxT


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


def _publish(
    area: pathlib.Path, folder: pathlib.Path, log: Callable[[str], None]
) -> None:
  """Renames the complete entry ``area / folder.name`` to ``folder``,
  unless a valid one is there (another run published it first: it is
  kept). An invalid one is moved into ``area`` first, deleted with it. The
  check and the renames hold the lock of ``folder``'s parent (every
  publisher's), so a valid entry is never moved away."""
  with staging.locked(folder.parent):
    if os.path.lexists(folder):
      problem = entry_problem(folder)
      if problem is None:
        log(f"warm start: another run published {folder} first; using it")
        return
      log(f"warm start: replacing the invalid {folder} ({problem})")
      os.rename(folder, area / f"{folder.name}.invalid")
    os.rename(area / folder.name, folder)


def warm_start(
    policy: PolicyConfig,
    examples: Sequence[dict],
    seed: int = 0,
    max_length: Optional[int] = None,
    environment: str = "",
    log=print,
) -> pathlib.Path:
  """Trains (or reuses) the tiny policy on worked answers; returns its folder.

  Args:
    policy: sizes and supervised-training settings.
    examples: training examples with ``prompt`` and ``answer``.
    seed: initialization and batching seed.
    max_length: context length of the decoder; ``None``: that of
      :func:`context_tokens`.
    environment: the run's ``task.environment``: the context length, and
      with ``"calculator"`` the warm start
      learns from tool-using episodes (:func:`tool_demonstrations`) instead
      of worked answers.
    log: where progress lines go.

  Returns:
    A Hugging Face folder with ``config.json``, ``model.safetensors`` and
    ``tokenizer.json``: a valid cached one (an invalid one is rebuilt,
    saying why), else one trained now and published atomically.
  """
  folder = cache_folder(policy, examples, seed, environment)
  if folder.exists():
    problem = entry_problem(folder)
    if problem is None:
      log(f"warm start: reusing {folder}")
      return folder
    log(f"warm start: rebuilding the invalid {folder} ({problem})")
  tokenizer = char_tokenizer()
  max_length = max_length or context_tokens(environment)
  config = tiny_decoder_config(policy, tokenizer, max_length)
  model = models.init_model(config, rngs=seed)
  graphdef, params = models.split_model(model)
  if environment == DEMONSTRATED:
    tokens, loss_mask = tool_demonstrations(examples, tokenizer, max_length)
  else:
    batch = encode_sft(
        tokenizer,
        [e["prompt"] for e in examples],
        [e["answer"] for e in examples],
    )
    tokens, loss_mask = batch.tokens_BxT, batch.loss_mask_BxT
  tokens_NxT = jnp.asarray(tokens)
  loss_mask_NxT = jnp.asarray(loss_mask, jnp.float32)
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
    index = rng.integers(0, len(examples), policy.warm_start_batch)
    params, opt_state, loss = sft_step(params, opt_state, jnp.asarray(index))
    if (step + 1) % max(1, policy.warm_start_steps // 4) == 0:
      log(
          f"warm start: step {step + 1}/{policy.warm_start_steps} "
          f"loss {float(loss):.4f}"
      )
  with staging.staging_area(folder) as area:
    staged = area / folder.name
    models.save_pretrained(nnx.merge(graphdef, params), staged)
    tokenizer.save_pretrained(staged)
    _publish(area, folder, log)
  return folder
