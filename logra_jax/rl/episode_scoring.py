"""Scoring episodes: multi-turn rollouts in an environment
(:mod:`logra_jax.envs`) as the learner's batch, and held-out evaluation.

Each turn of every episode is sampled by the engine's ``sample`` (turn
``j > 0`` with the key ``fold_in(key, j)``); an episode is scored once, by
the run's reward functions on its answer plus the environment's own
rewards, and is one row of the learner's batch with its group advantage
(:func:`envs.episode_rows`): the environment's tokens are attended to
(``context_mask_BxT``) and never in the loss (``completion_mask_BxT``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import envs
from logra_jax import parallel
from logra_jax import serve
from logra_jax.configs import TrainConfig
from logra_jax.rl import algo
from logra_jax.rl import rewards as rewards_lib
from logra_jax.rl import scoring
from logra_jax.rollout.engine import Policy, SampleFn

Rewards = list[tuple[Callable, float]]


def play(
    policy: Policy,
    sample: SampleFn,
    examples: Sequence[dict],
    episodes: envs.EpisodeConfig,
    key: jax.Array,
    **settings,
) -> list[envs.Episode]:
  """One episode per example, each turn sampled by ``sample`` with
  ``settings`` (``max_new_tokens``, ``temperature``, ...); a ``verifiers``
  taskset's episodes are played through the endpoint."""
  if isinstance(episodes.factory, envs.VerifiersTaskset):
    return serve.play_verifiers(
        episodes.factory,
        policy,
        sample,
        examples,
        key,
        max_turns=episodes.max_turns,
        **settings,
    )

  def sample_turn(histories, turn):
    turn_key = key if turn == 0 else jax.random.fold_in(key, turn)
    out = sample(histories, turn_key, **settings)
    return tuple(
        parallel.host_value(x) for x in (out.tokens, out.logprobs, out.lengths)
    )

  return envs.run_episodes(
      episodes,
      examples,
      envs.Renderer(policy.tokenizer, policy.chat, policy.system_prompt),
      sample_turn,
      stop_ids=policy.sampler.config.eos_token_ids,
      context=policy.sampler.max_length - settings["max_new_tokens"],
  )


def episode_rewards(
    rewards: Rewards,
    examples: Sequence[dict],
    group: int,
    played: list[envs.Episode],
) -> tuple[rewards_lib.RewardReport, np.ndarray]:
  """The report of the run's reward functions on the answers of episodes
  (``group`` per example), and each episode's reward: that plus the
  environment's own rewards."""
  report = scoring.score(
      rewards,
      [e["prompt"] for e in examples for _ in range(group)],
      [episode.answer for episode in played],
      scoring.example_columns(examples, group),
  )
  return report, report.rewards + np.array([e.reward for e in played])


def evaluate_episodes(
    policy: Policy,
    sample: SampleFn,
    examples: Sequence[dict],
    rewards: Rewards,
    max_new_tokens: int,
    episodes: envs.EpisodeConfig,
    batch_size: int = 256,
) -> dict[str, float]:
  """Held-out accuracy (fraction of episodes that score at least 1.0) and
  mean score of greedy episodes."""
  scores = []
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start : start + batch_size])
    played = play(
        policy,
        sample,
        chunk,
        episodes,
        jax.random.key(0),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
    )
    scores.append(episode_rewards(rewards, chunk, 1, played)[1])
  scores = np.concatenate(scores)
  return {
      "accuracy": float(np.mean(scores >= 1.0)),
      "score": float(np.mean(scores)),
  }


def _metrics(played: list[envs.Episode], rewards_N, sequences) -> dict:
  """The episodes' metrics: rewards, lengths, turns, tool calls, failures."""
  model_tokens = np.array([sum(map(len, e.turns)) for e in played])
  return {
      "reward/total": float(np.mean(rewards_N)),
      "reward/environment": float(np.mean([e.reward for e in played])),
      "accuracy/train": float(np.mean(rewards_N >= 1.0)),
      "completion_length": float(np.mean(model_tokens)),
      "completion_length/max": float(model_tokens.max()),
      "env/turns_per_episode": float(np.mean([len(e.turns) for e in played])),
      "env/tokens_per_episode": float(np.mean(list(map(len, sequences)))),
      "env/tool_calls": float(sum(e.tool_calls for e in played)),
      "env/failures": float(sum(e.failures for e in played)),
      "env/timeouts": float(sum(e.timeouts for e in played)),
      "env/truncated_fraction": float(np.mean([e.truncated for e in played])),
  }


def scored_episodes(
    policy: Policy,
    sample: SampleFn,
    config: TrainConfig,
    rewards: Rewards,
    episodes: envs.EpisodeConfig,
    examples: Sequence[dict],
    key: jax.Array,
) -> scoring.Rollout:
  """``num_generations`` episodes per example, scored per episode, as the
  learner's batch of one row per episode (``examples`` and
  ``key`` are the arguments a rollout pipeline's ``rollout_fn`` takes)."""
  group = config.rollout.num_generations
  repeated = [e for e in examples for _ in range(group)]
  played = play(
      policy,
      sample,
      repeated,
      episodes,
      key,
      max_new_tokens=config.rollout.max_new_tokens,
      temperature=config.rollout.temperature,
      top_p=config.rollout.top_p,
      top_k=config.rollout.top_k,
  )
  report, rewards_N = episode_rewards(rewards, examples, group, played)
  sequences = [envs.episode_sequence(e)[0] for e in played]
  longest = max(map(len, sequences))
  rows = envs.episode_rows(
      played,
      algo.bucket_width(longest, max(longest, policy.sampler.max_length)),
      policy.sampler.pad_id,
      policy.sampler.bucket_size,
  )
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=jnp.asarray(rows.prompt_ids_ExP),
      prompt_mask_BxP=jnp.asarray(rows.prompt_mask_ExP),
      completion_tokens_BxT=jnp.asarray(rows.tokens_ExT),
      completion_mask_BxT=jnp.asarray(rows.mask_ExT),
      old_logp_BxT=jnp.asarray(rows.logprobs_ExT),
      advantages_B=algo.compute_advantages(
          jnp.asarray(rewards_N, jnp.float32), group, config.advantage
      ),
      num_generations=group,
      context_mask_BxT=jnp.asarray(rows.context_mask_ExT),
  )
  prompt_width = algo.bucket_width(
      int(rows.prompt_mask_ExP.sum(axis=1).max()),
      batch.prompt_tokens_BxP.shape[1],
  )
  batch = batch.trimmed(prompt_width, batch.completion_tokens_BxT.shape[1])
  metrics = report.metrics()
  metrics["batch/prompt_width"] = float(prompt_width)
  metrics["batch/completion_width"] = float(rows.tokens_ExT.shape[1])
  metrics.update(_metrics(played, rewards_N, sequences))
  samples = scoring.RolloutSamples(
      [e["prompt"] for e in repeated],
      [policy.tokenizer.decode(ids) for ids in sequences],
      scoring.example_columns(examples, group),
      report,
  )
  return scoring.Rollout(batch, metrics, samples)
