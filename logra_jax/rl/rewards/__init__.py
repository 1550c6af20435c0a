"""Reward functions and a guarded evaluator that never lets a bad reward stop training.

A reward function maps a batch to one float per completion::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where each keyword is a task column (``answer``, ``entry``, ...) as a list aligned with the
prompts; functions take ``**columns`` and ignore the ones they do not use. Shipped:
reasoning-gym verification (:func:`reasoning_gym_reward`), math-verify equivalence
(:func:`math_verify_equivalence`), the last number's value (:func:`final_number_match`),
normalized exact match (:func:`exact_match`) and a regex format reward (:func:`format_reward`);
:func:`combine_rewards` weights several into one.
Functions are called with keywords (``fn(prompts=..., completions=..., **columns)``), as TRL
and Tunix call theirs, so their reward functions work unchanged; :func:`load_reward_function`
imports one by ``module:function`` or ``path/to/file.py:function``, and
:func:`check_reward_functions` tries each on a few reference answers before a run compiles.

:func:`evaluate_rewards` runs them sample by sample off the main thread with a per-sample
deadline and a per-batch one (:class:`TimedReward` carries a function's own, a run's
``rewards.batch_timeout_s``): a sample whose reward raises, returns a non-number, runs past
``timeout_s`` or is not reached within the batch deadline gets 0 and is counted, and the run
goes on. :class:`RewardFailureWarnings` turns a
reward that fails on most of a batch (e.g. unparseable reference answers) into a
rate-limited console warning.
"""

from logra_jax.rl.rewards.builtin import combine_rewards
from logra_jax.rl.rewards.builtin import exact_match
from logra_jax.rl.rewards.builtin import final_number_match
from logra_jax.rl.rewards.builtin import format_reward
from logra_jax.rl.rewards.builtin import math_verify_equivalence
from logra_jax.rl.rewards.builtin import reasoning_gym_reward
from logra_jax.rl.rewards.builtin import RewardFn
from logra_jax.rl.rewards.builtin import ScoreAnswer
from logra_jax.rl.rewards.guarded import evaluate_rewards
from logra_jax.rl.rewards.guarded import RewardFailureWarnings
from logra_jax.rl.rewards.guarded import RewardReport
from logra_jax.rl.rewards.guarded import TimedReward
from logra_jax.rl.rewards.loading import check_reward_functions
from logra_jax.rl.rewards.loading import load_reward_function

__all__ = [
    "RewardFn",
    "ScoreAnswer",
    "reasoning_gym_reward",
    "math_verify_equivalence",
    "final_number_match",
    "exact_match",
    "format_reward",
    "combine_rewards",
    "load_reward_function",
    "check_reward_functions",
    "evaluate_rewards",
    "RewardReport",
    "RewardFailureWarnings",
    "TimedReward",
]
