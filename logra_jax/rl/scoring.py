"""Scoring what the rollout engine samples: rollout batches with their
rewards and group advantages, and held-out evaluation.

The engine (:mod:`logra_jax.rollout.engine`) only samples; each function
here takes the policy (its tokenizer encodes prompts and decodes
completions) and either its ``params`` (:func:`rollout`, :func:`evaluate`)
or any sample function, e.g. an engine's ``sample`` (:func:`rollout_with`,
:func:`evaluate_with`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import parallel
from logra_jax.configs import TrainConfig
from logra_jax.rl import algo
from logra_jax.rl import losses
from logra_jax.rl import rewards as rewards_lib
from logra_jax.rollout.engine import Policy, SampleFn


def example_columns(examples: Sequence[dict], repeat: int) -> dict[str, list]:
  """The examples' fields other than the prompt, each row ``repeat`` times."""
  keys = [k for k in examples[0] if k != "prompt"]
  return {k: [e[k] for e in examples for _ in range(repeat)] for k in keys}


def evaluate(
    policy: Policy,
    params,
    examples: Sequence[dict],
    rewards: list[tuple[Callable, float]],
    max_new_tokens: int,
    batch_size: int = 256,
) -> dict[str, float]:
  """Greedy held-out accuracy (fraction of completions the verifier scores
  1.0) and mean score."""
  return evaluate_with(
      policy,
      functools.partial(policy.sampler.sample, params),
      examples,
      rewards,
      max_new_tokens,
      batch_size,
  )


def score(
    rewards: list[tuple[Callable, float]],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
) -> rewards_lib.RewardReport:
  """The rewards of a batch. With several processes each scores its own
  share of the rows (:func:`parallel.process_rows`) and every process gets
  the whole report (first errors: this process's own)."""
  if jax.process_count() == 1:
    return rewards_lib.evaluate_rewards(rewards, prompts, completions, columns)
  n = len(prompts)
  rows = parallel.process_rows(n)
  mine = rewards_lib.evaluate_rewards(
      rewards,
      prompts[rows],
      completions[rows],
      {name: values[rows] for name, values in columns.items()},
  )
  names = list(mine.per_function)
  counts = parallel.sum_over_processes(
      np.array([[mine.failures[k], mine.timeouts[k]] for k in names], np.int64)
  )
  return rewards_lib.RewardReport(
      rewards=parallel.gather_rows(mine.rewards, n),
      per_function={
          k: parallel.gather_rows(mine.per_function[k], n) for k in names
      },
      failures={k: int(c[0]) for k, c in zip(names, counts)},
      timeouts={k: int(c[1]) for k, c in zip(names, counts)},
      first_errors=mine.first_errors,
  )


def evaluate_with(
    policy: Policy,
    sample: SampleFn,
    examples: Sequence[dict],
    rewards: list[tuple[Callable, float]],
    max_new_tokens: int,
    batch_size: int = 256,
) -> dict[str, float]:
  """:func:`evaluate` with ``sample`` (e.g. an engine's ``sample``)."""
  scores = []
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start : start + batch_size])
    prompts = [e["prompt"] for e in chunk]
    out = sample(
        policy.encode(prompts),
        jax.random.key(0),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
    )
    report = score(
        rewards,
        prompts,
        policy.decode(parallel.host_value(out.tokens)),
        example_columns(chunk, 1),
    )
    scores.append(report.rewards)
  scores = np.concatenate(scores)
  return {
      "accuracy": float(np.mean(scores >= 1.0)),
      "score": float(np.mean(scores)),
  }


@dataclasses.dataclass(frozen=True)
class RolloutSamples:
  """What a rollout sampled and how it was scored, for logs and warnings.

  Attributes:
    prompts: the prompt of each completion (``num_generations`` in a row
      per prompt), before any chat template.
    completions: the decoded completions.
    columns: the examples' other fields, aligned with the completions.
    report: the rewards of each completion.
  """

  prompts: list[str]
  completions: list[str]
  columns: dict[str, list]
  report: rewards_lib.RewardReport


def rollout(
    policy: Policy,
    params,
    examples: Sequence[dict],
    config: TrainConfig,
    rewards: list[tuple[Callable, float]],
    key: jax.Array,
    observe: Optional[Callable[[RolloutSamples], None]] = None,
) -> tuple[algo.RolloutBatch, dict[str, float]]:
  """Samples ``num_generations`` completions per prompt, scores them and
  computes group advantages; ``observe`` (e.g. a sample log) sees each
  batch's :class:`RolloutSamples`. The batch is cut to
  :func:`algo.bucket_width` of its longest prompt and completion (metrics
  ``batch/prompt_width``, ``batch/completion_width``), so the learner's
  step costs what the rollouts need, not what ``max_new_tokens`` allows."""
  return rollout_with(
      policy,
      functools.partial(policy.sampler.sample, params),
      examples,
      config,
      rewards,
      key,
      observe,
  )


def rollout_with(
    policy: Policy,
    sample: SampleFn,
    examples: Sequence[dict],
    config: TrainConfig,
    rewards: list[tuple[Callable, float]],
    key: jax.Array,
    observe: Optional[Callable[[RolloutSamples], None]] = None,
    pool: Sequence[dict] = (),
) -> tuple[algo.RolloutBatch, dict[str, float]]:
  """:func:`rollout` with ``sample`` (e.g. an engine's ``sample``); with
  ``rollout.dynamic_sampling``, :func:`dynamic_rollout` with more prompts
  drawn from ``pool``."""
  if config.rollout.dynamic_sampling:
    return dynamic_rollout(
        policy, sample, examples, config, rewards, key, pool, observe
    )
  group = config.rollout.num_generations
  scored = _sample_and_score(policy, sample, examples, config, rewards, key)
  if observe is not None:
    observe(scored.samples)
  out = scored.out
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=out.prompt_ids,
      prompt_mask_BxP=out.prompt_mask,
      completion_tokens_BxT=out.tokens,
      completion_mask_BxT=scored.mask_BxT,
      old_logp_BxT=out.logprobs,
      advantages_B=algo.compute_advantages(
          scored.rewards_N, group, config.advantage
      ),
      num_generations=group,
  )
  return trimmed_with_metrics(
      batch,
      config,
      scored.samples.report,
      scored.longest_prompt,
      scored.lengths,
      scored.shaping,
  )


class _Scored(NamedTuple):
  """``num_generations`` completions of each prompt of a batch, scored: the
  sampler's output, what was sampled, the longest prompt and the completion
  lengths (host), the rewards the advantages take (with overlong shaping),
  the loss mask and the shaping metrics."""

  out: Any
  samples: RolloutSamples
  longest_prompt: int
  lengths: np.ndarray
  rewards_N: jax.Array
  mask_BxT: jax.Array
  shaping: dict[str, float]


def _sample_and_score(
    policy: Policy,
    sample: SampleFn,
    examples: Sequence[dict],
    config: TrainConfig,
    rewards: list[tuple[Callable, float]],
    key: jax.Array,
) -> _Scored:
  """Samples ``num_generations`` completions per example and scores them."""
  group = config.rollout.num_generations
  prompts = [e["prompt"] for e in examples for _ in range(group)]
  prompt_ids = policy.encode(prompts)
  out = sample(
      prompt_ids,
      key,
      max_new_tokens=config.rollout.max_new_tokens,
      temperature=config.rollout.temperature,
      top_p=config.rollout.top_p,
      top_k=config.rollout.top_k,
  )
  completions = policy.decode(parallel.host_value(out.tokens))
  columns = example_columns(examples, group)
  report = score(rewards, prompts, completions, columns)
  rewards_N = jnp.asarray(report.rewards, jnp.float32)
  lengths = parallel.host_value(out.lengths)
  rewards_N, mask_BxT, shaping = _overlong_shaping(
      config, policy, out, lengths, rewards_N
  )
  return _Scored(
      out,
      RolloutSamples(prompts, completions, columns, report),
      max(map(len, prompt_ids)),
      lengths,
      rewards_N,
      mask_BxT,
      shaping,
  )


def trimmed_with_metrics(
    batch: algo.RolloutBatch,
    config: TrainConfig,
    report: rewards_lib.RewardReport,
    longest_prompt: int,
    lengths: np.ndarray,
    shaping: dict[str, float],
) -> tuple[algo.RolloutBatch, dict[str, float]]:
  """The batch cut to its widths, and the rollout's metrics."""
  # The learner's batch is no wider than its longest prompt and completion,
  # rounded up to one of a few widths (each compiles the train step once).
  batch = batch.trimmed(
      algo.bucket_width(longest_prompt, batch.prompt_tokens_BxP.shape[1]),
      algo.bucket_width(int(lengths.max()), config.rollout.max_new_tokens),
  )
  metrics = report.metrics()
  metrics["accuracy/train"] = float(np.mean(report.rewards >= 1.0))
  metrics["completion_length"] = float(np.mean(lengths))
  metrics["completion_length/max"] = float(lengths.max())
  metrics["batch/prompt_width"] = float(batch.prompt_tokens_BxP.shape[1])
  metrics["batch/completion_width"] = float(
      batch.completion_tokens_BxT.shape[1]
  )
  metrics.update(shaping)
  return batch, metrics


def dynamic_rollout(
    policy: Policy,
    sample: SampleFn,
    examples: Sequence[dict],
    config: TrainConfig,
    rewards: list[tuple[Callable, float]],
    key: jax.Array,
    pool: Sequence[dict],
    observe: Optional[Callable[[RolloutSamples], None]] = None,
) -> tuple[algo.RolloutBatch, dict[str, float]]:
  """DAPO's dynamic sampling: a rollout of ``examples`` whose groups of
  equal rewards (no advantage) are replaced by groups of more prompts.

  Round ``r >= 1`` samples ``len(examples)`` prompts drawn from ``pool``
  without replacement by ``fold_in(key, r)`` (so a rollout depends only on
  its examples and key, and a resumed or asynchronous run draws the same),
  until the batch holds as many groups with unequal rewards as ``examples``
  or ``rollout.max_resample_rounds`` rounds are spent; the places left are
  filled with equal-reward groups whose completions are masked from the
  loss. Rewards and accuracy metrics are round 0's (the stream's prompts);
  ``observe`` sees round 0.

  Example:
    >>> rewards_PxG = np.array([[1., 0.], [1., 1.]])
    >>> rewards_PxG.max(axis=1) > rewards_PxG.min(axis=1)   # kept groups
    array([ True, False])
  """
  if not pool:
    raise ValueError(
        "rollout.dynamic_sampling needs the training prompts to draw from"
    )
  group, wanted = config.rollout.num_generations, len(examples)
  draws = itertools.chain(
      [(examples, key)],
      (
          _round_draw(pool, wanted, key, r)
          for r in range(1, config.rollout.max_resample_rounds + 1)
      ),
  )
  rounds, kept, equal = [], [], []
  for r, (batch_examples, sample_key) in enumerate(draws):
    scored = _sample_and_score(
        policy, sample, batch_examples, config, rewards, sample_key
    )
    rounds.append(scored)
    rewards_PxG = np.asarray(scored.rewards_N).reshape(-1, group)
    varied_P = rewards_PxG.max(axis=1) > rewards_PxG.min(axis=1)
    for g, varied in enumerate(varied_P):
      (kept if varied else equal).append((r, g))
    if len(kept) >= wanted:
      break
  if observe is not None:
    observe(rounds[0].samples)
  masked = max(wanted - len(kept), 0)
  chosen = kept[:wanted] + equal[:masked]
  batch, lengths = _merged_batch(rounds, chosen, wanted - masked, config)
  batch, metrics = trimmed_with_metrics(
      batch,
      config,
      rounds[0].samples.report,
      max(scored.longest_prompt for scored in rounds),
      lengths,
      rounds[0].shaping,
  )
  metrics["rollout/resample_rounds"] = float(len(rounds) - 1)
  metrics["rollout/dropped_groups"] = float(len(equal))
  metrics["rollout/masked_groups"] = float(masked)
  return batch, metrics


def _round_draw(
    pool: Sequence[dict], wanted: int, key: jax.Array, r: int
) -> tuple[list[dict], jax.Array]:
  """Round ``r``'s prompts, ``wanted`` drawn from ``pool`` without
  replacement by ``fold_in(key, r)``, and its sampling key."""
  draw_key, sample_key = jax.random.split(jax.random.fold_in(key, r))
  picks = jax.random.choice(draw_key, len(pool), (wanted,), replace=False)
  return [pool[int(i)] for i in np.asarray(picks)], sample_key


def _merged_batch(
    rounds: list[_Scored],
    chosen: list[tuple[int, int]],
    trained: int,
    config: TrainConfig,
) -> tuple[algo.RolloutBatch, np.ndarray]:
  """The learner's batch of the ``chosen`` ``(round, group)`` groups (the
  first ``trained`` of them trained on, the rest masked), prompts
  left-padded to the widest round's; and the completions' lengths."""
  group = config.rollout.num_generations
  width = max(scored.out.prompt_ids.shape[1] for scored in rounds)
  used = sorted({r for r, _ in chosen})
  # Each round's arrays on the host once (an all-gather across processes).
  fields = {
      "prompt_ids": lambda s: s.out.prompt_ids,
      "prompt_mask": lambda s: s.out.prompt_mask,
      "tokens": lambda s: s.out.tokens,
      "mask": lambda s: s.mask_BxT,
      "logprobs": lambda s: s.out.logprobs,
      "rewards": lambda s: s.rewards_N,
      "lengths": lambda s: s.lengths,
  }
  host = {
      (r, name): parallel.host_value(get(rounds[r]))
      for r in used
      for name, get in fields.items()
  }

  def gather(name, left_pad=False):
    parts = [host[r, name][g * group : (g + 1) * group] for r, g in chosen]
    if left_pad:
      parts = [np.pad(x, ((0, 0), (width - x.shape[1], 0))) for x in parts]
    return np.concatenate(parts)

  mask_BxT = gather("mask")
  mask_BxT[trained * group :] = 0
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=jnp.asarray(gather("prompt_ids", True)),
      prompt_mask_BxP=jnp.asarray(gather("prompt_mask", True)),
      completion_tokens_BxT=jnp.asarray(gather("tokens")),
      completion_mask_BxT=jnp.asarray(mask_BxT),
      old_logp_BxT=jnp.asarray(gather("logprobs")),
      advantages_B=algo.compute_advantages(
          jnp.asarray(gather("rewards")), group, config.advantage
      ),
      num_generations=group,
  )
  return batch, gather("lengths")


def _overlong_shaping(
    config: TrainConfig, policy: Policy, out, lengths, rewards_N
):
  """DAPO's overlong shaping of a rollout (``loss.overlong_buffer``,
  ``loss.mask_truncated``): the rewards with the length penalty added, the
  completion mask without the truncated rows, and their metrics (none when
  both are off)."""
  loss = config.loss
  if not (loss.overlong_buffer or loss.mask_truncated):
    return rewards_N, out.mask, {}
  budget = config.rollout.max_new_tokens
  truncated_N = losses.truncated(
      parallel.host_value(out.tokens),
      lengths,
      budget,
      policy.sampler.config.eos_token_ids,
  )
  penalty_N = losses.overlong_penalty(
      lengths, budget, loss.overlong_buffer, loss.overlong_penalty
  )
  mask_BxT = out.mask
  if loss.mask_truncated:
    mask_BxT = out.mask * jnp.asarray(~truncated_N[:, None], out.mask.dtype)
  metrics = {
      "rollout/truncated_fraction": float(np.mean(truncated_N)),
      "reward/overlong_penalty": float(np.mean(penalty_N)),
  }
  return rewards_N + jnp.asarray(penalty_N), mask_BxT, metrics


class Rollout(NamedTuple):
  """A scored rollout batch: the learner's batch, its metrics and what was
  sampled."""

  batch: algo.RolloutBatch
  metrics: dict[str, float]
  samples: RolloutSamples


def scored_rollout(
    policy: Policy,
    sample: SampleFn,
    config: TrainConfig,
    rewards: list[tuple[Callable, float]],
    examples: Sequence[dict],
    key: jax.Array,
    pool: Sequence[dict] = (),
) -> Rollout:
  """:func:`rollout_with`, with what it sampled (``examples`` and ``key``
  are the arguments a rollout pipeline's ``rollout_fn`` takes; ``pool``,
  the prompts dynamic sampling draws from)."""
  seen = []
  batch, metrics = rollout_with(
      policy, sample, examples, config, rewards, key, seen.append, pool
  )
  return Rollout(batch, metrics, seen[0])
