"""The shipped reward functions and their weighted sum.

Reasoning-gym verification (:func:`reasoning_gym_reward`), math-verify
equivalence (:func:`math_verify_equivalence`), the last number's value
(:func:`final_number_match`), normalized exact match (:func:`exact_match`)
and a regex format reward (:func:`format_reward`);
:func:`combine_rewards` weights several into one.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import math_verify
import numpy as np
import reasoning_gym

RewardFn = Callable[..., list[float]]
ScoreAnswer = Callable[[str | None, Mapping[str, Any]], float]


def _check_columns(
    name: str, completions: Sequence[str], **columns: Sequence[Any]
) -> None:
  """Raises when a needed column is missing or misaligned with the completions."""
  for column, values in columns.items():
    if values is None:
      raise ValueError(
          f"reward {name} needs the {column!r} column; pass {column}=[...]."
      )
    if len(values) != len(completions):
      raise ValueError(
          f"reward {name}: column {column!r} has {len(values)} values for "
          f"{len(completions)} completions."
      )


@functools.cache
def _reasoning_gym_scorer(dataset_name: str) -> ScoreAnswer:
  """The ``score_answer`` of a reasoning-gym dataset with default config (cached)."""
  return reasoning_gym.get_score_answer_fn(dataset_name)


def reasoning_gym_reward(score_answer: ScoreAnswer | None = None) -> RewardFn:
  """Reward from a reasoning-gym verifier: ``score_answer(completion, entry)`` in [0, 1].

  Args:
    score_answer: the verifier of the configured generator (``Task.score_answer``); ``None``
      looks it up per example from ``entry["metadata"]["source_dataset"]`` (default config),
      which also serves mixed-task batches.

  Returns:
    A reward function reading the ``entry`` column (the generator's items).

  Example:
    >>> from logra_jax.data.tasks import tiny_arithmetic_task
    >>> task = tiny_arithmetic_task(size=2)
    >>> reward = reasoning_gym_reward(task.score_answer)
    >>> reward(["4-1="], ["3"], entry=[task.examples[1]["entry"]])
    [1.0]
  """

  def reasoning_gym_score(
      prompts: Sequence[str],
      completions: Sequence[str],
      *,
      entry: Sequence[Mapping[str, Any]] | None = None,
      **unused: Any,
  ) -> list[float]:
    del prompts, unused
    _check_columns("reasoning_gym_score", completions, entry=entry)
    scores = []
    for completion, item in zip(completions, entry):
      score_fn = score_answer or _reasoning_gym_scorer(
          item["metadata"]["source_dataset"]
      )
      scores.append(float(score_fn(completion.strip(), item)))
    return scores

  return reasoning_gym_score


def math_verify_equivalence(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[str] | None = None,
    **unused: Any,
) -> list[float]:
  r"""1.0 when math-verify finds the completion's answer equivalent to the reference.

  Both sides go through ``math_verify.parse`` (LaTeX and plain expressions, e.g.
  ``"\frac{84}{2}"`` equals ``"42"``) and ``math_verify.verify``. math-verify's own
  signal-based timeouts are disabled (they only work on the main thread); run this through
  :func:`evaluate_rewards`, whose deadline covers a hanging comparison.

  Args:
    prompts: unused.
    completions: model outputs.
    answer: reference answers (the ``answer`` column).
    **unused: other columns, ignored.

  Returns:
    1.0 or 0.0 per completion.

  Raises:
    ValueError: when a reference answer cannot be parsed (a data problem).

  Example:
    >>> math_verify_equivalence(["q"], ["so it is $\\frac{84}{2}$"], answer=["42"])
    [1.0]
  """
  del prompts, unused
  _check_columns("math_verify_equivalence", completions, answer=answer)
  scores = []
  for completion, reference in zip(completions, answer):
    gold = math_verify.parse(str(reference), parsing_timeout=None)
    if not gold:
      raise ValueError(
          f"math-verify cannot parse the reference answer {reference!r}."
      )
    pred = math_verify.parse(completion, parsing_timeout=None)
    scores.append(
        float(
            bool(pred) and math_verify.verify(gold, pred, timeout_seconds=None)
        )
    )
  return scores


# A decimal number as written in text: an optional minus sign joined to its
# digits, an optional fraction ("12." is 12 before a full stop).
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[str] | None = None,
    **unused: Any,
) -> list[float]:
  """1.0 when the last number written in the completion equals the reference.

  For tasks whose answer is one number and whose question is an expression
  (chain sums, arithmetic): :func:`math_verify_equivalence` accepts a
  completion that repeats the question's expression ("The final answer is
  20 - 54 = 12." for -34: math-verify evaluates ``20 - 54``), which a policy
  learns to write instead of answering; here the last number, 12, is the
  answer given. Numbers compare by value (``"8.0"`` matches ``"8"``); a minus
  sign counts only where it touches the digits (``"20 - 54"`` ends in 54).
  Plain decimals only: ``"1,234"`` reads as 234 and ``"1e5"`` as 5, and a
  reference written so is refused.

  Args:
    prompts: unused.
    completions: model outputs.
    answer: reference answers (the ``answer`` column), each one number.
    **unused: other columns, ignored.

  Returns:
    1.0 or 0.0 per completion.

  Raises:
    ValueError: when a reference answer is not one number (a data problem).

  Example:
    >>> final_number_match(
    ...     ["q"] * 3,
    ...     ["The answer is -34.", "20 - 54 = 12.", "20 - 54 ="],
    ...     answer=["-34"] * 3,
    ... )
    [1.0, 0.0, 0.0]
  """
  del prompts, unused
  _check_columns("final_number_match", completions, answer=answer)
  scores = []
  for completion, reference in zip(completions, answer):
    if not _NUMBER.fullmatch(str(reference).strip()):
      raise ValueError(
          f"final_number_match needs one number as the answer, got "
          f"{reference!r}."
      )
    given = _NUMBER.findall(completion)
    scores.append(float(bool(given) and float(given[-1]) == float(reference)))
  return scores


def _normalize(text: str) -> str:
  """Collapses whitespace runs to one space and strips the ends."""
  return " ".join(str(text).split())


def exact_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[str] | None = None,
    **unused: Any,
) -> list[float]:
  """1.0 when the completion equals the reference answer up to whitespace.

  Args:
    prompts: unused.
    completions: model outputs.
    answer: reference answers (the ``answer`` column).
    **unused: other columns, ignored.

  Returns:
    1.0 or 0.0 per completion.

  Example:
    >>> exact_match(["q", "q"], [" 12 ", "1 2"], answer=["12", "12"])
    [1.0, 0.0]
  """
  del prompts, unused
  _check_columns("exact_match", completions, answer=answer)
  return [
      float(_normalize(c) == _normalize(a)) for c, a in zip(completions, answer)
  ]


def format_reward(
    pattern: str, *, flags: int = re.DOTALL, name: str = "format"
) -> RewardFn:
  r"""Reward 1.0 for completions that fully match a regular expression, else 0.0.

  Args:
    pattern: the regex, matched with ``re.fullmatch`` against the stripped completion.
    flags: ``re`` flags (``re.DOTALL`` by default so ``.`` spans lines).
    name: the reward's name in metrics.

  Returns:
    A reward function using no column.

  Example:
    >>> format_reward(r"-?\d+")(["q", "q"], ["-12", "12 apples"])
    [1.0, 0.0]
  """
  compiled = re.compile(pattern, flags)

  def reward(
      prompts: Sequence[str], completions: Sequence[str], **unused: Any
  ) -> list[float]:
    del prompts, unused
    return [
        float(compiled.fullmatch(c.strip()) is not None) for c in completions
    ]

  reward.__name__ = name
  return reward


# Rewards and their weights are used in float32 (the weighted sum, the
# advantages, the loss): a value finite in float64 beyond float32's range
# (1e39, 1e300) would be inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def finite_in_float32(value: float) -> bool:
  """Whether ``value`` is finite in float32, the dtype rewards are used in.

  Example:
    >>> finite_in_float32(1e38), finite_in_float32(1e39), finite_in_float32(1e300)
    (True, False, False)
  """
  return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def check_weights(weighted: Sequence[tuple[RewardFn, Any]]) -> None:
  """Raises a ValueError naming a reward whose weight is not a number finite
  in float32."""
  for name, (_, weight) in zip(
      reward_names([fn for fn, _ in weighted]), weighted
  ):
    if (
        isinstance(weight, bool)
        or not isinstance(weight, numbers.Real)
        or not finite_in_float32(float(weight))
    ):
      raise ValueError(
          f"reward {name!r}: weight must be a finite number within float32's "
          f"range (|w| <= {FLOAT32_MAX:.4g}), got {weight!r}."
      )


def combine_rewards(
    weighted: Sequence[tuple[RewardFn, float]], name: str = "combined"
) -> RewardFn:
  r"""One reward function: the weighted sum :math:`R = \sum_k w_k R_k`.

  To get per-function failure counts and metrics, pass the list to :func:`evaluate_rewards`
  instead of combining first.

  Args:
    weighted: ``(reward_fn, weight)`` pairs; weights are finite numbers
      (negative ones are penalties).
    name: the combined reward's name.

  Returns:
    A reward function passing every column to every part.

  Example:
    >>> r = combine_rewards([(exact_match, 1.0), (format_reward(r"\d+"), 0.1)])
    >>> r(["q"], ["12"], answer=["12"])
    [1.1]
  """
  if not weighted:
    raise ValueError(
        "combine_rewards needs at least one (reward_fn, weight) pair."
    )
  check_weights(weighted)

  def reward(
      prompts: Sequence[str], completions: Sequence[str], **columns: Any
  ) -> list[float]:
    total = np.zeros(len(completions), np.float64)
    for fn, weight in weighted:
      total += weight * np.asarray(
          fn(prompts=prompts, completions=completions, **columns), np.float64
      )
    return total.tolist()

  reward.__name__ = name
  return reward


def reward_names(fns: Sequence[RewardFn]) -> list[str]:
  """Unique metric names from the functions' ``__name__`` (``_2``, ``_3`` on repeats;
  ``total``, the weighted sum's name, is taken)."""
  names: list[str] = []
  for fn in fns:
    base = getattr(fn, "__name__", type(fn).__name__)
    name, k = base, 1
    while name in names or name == "total":
      k += 1
      name = f"{base}_{k}"
    names.append(name)
  return names
