"""The guarded evaluator that never lets a bad reward stop training.

:func:`evaluate_rewards` runs the reward functions sample by sample off the
main thread with a per-sample deadline and a per-batch one: a sample whose
reward raises, returns a non-number, runs past ``timeout_s`` or is not reached
within ``batch_timeout_s`` gets 0 and is counted, and the run goes on.
:class:`RewardFailureWarnings` turns a reward that fails on most of a batch
(e.g. unparseable reference answers), or that ran out of its batch deadline,
into a rate-limited console warning.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from logra_jax.checks import check_range
from logra_jax.rl.rewards.builtin import FLOAT32_MAX
from logra_jax.rl.rewards.builtin import check_weights
from logra_jax.rl.rewards.builtin import finite_in_float32
from logra_jax.rl.rewards.builtin import reward_names
from logra_jax.rl.rewards.builtin import RewardFn

# A function's per-batch deadline unless it carries its own (TimedReward).
BATCH_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class TimedReward:
  """A reward function with its own per-batch deadline.

  Called like ``fn`` and named like it; :func:`evaluate_rewards` stops it
  once ``batch_timeout_s`` seconds of a batch have passed (the samples not
  reached score 0 as timeouts) and :class:`RewardFailureWarnings` names the
  deadline. A run wraps each of its rewards in one, with
  ``rewards.batch_timeout_s``.

  Attributes:
    fn: the reward function.
    batch_timeout_s: seconds the function may spend on one batch.

  Example:
    >>> from logra_jax.rl.rewards import exact_match
    >>> timed = TimedReward(exact_match, batch_timeout_s=5.0)
    >>> timed.__name__, timed(["q"], ["12"], answer=["12"])
    ('exact_match', [1.0])
  """

  fn: RewardFn
  batch_timeout_s: float = BATCH_TIMEOUT_S

  def __post_init__(self):
    check_range("rewards.batch_timeout_s", self.batch_timeout_s, gt=0)

  @property
  def __name__(self) -> str:
    return getattr(self.fn, "__name__", type(self.fn).__name__)

  def __call__(self, prompts, completions, **columns) -> Any:
    return self.fn(prompts=prompts, completions=completions, **columns)


class Late(NamedTuple):
  """A function that ran out of its batch deadline: the seconds it took and
  the deadline."""

  seconds: float
  deadline_s: float


@dataclasses.dataclass(frozen=True)
class RewardReport:
  """Rewards of one batch from :func:`evaluate_rewards`, with per-function health.

  Attributes:
    rewards: float32 ``[N]``, the weighted sum over functions (failed samples count 0).
    per_function: name -> float32 ``[N]`` unweighted scores.
    failures: name -> number of samples whose reward raised or returned a non-finite or
      malformed value.
    timeouts: name -> number of samples past the deadline.
    first_errors: name -> description of the first failure or timeout (only names with
      any), to make a misconfigured reward visible.
    late: name -> :class:`Late` (seconds taken, deadline) of a function that
      did not finish the batch within its deadline (only names that ran out
      of it).
  """

  rewards: np.ndarray
  per_function: dict[str, np.ndarray]
  failures: dict[str, int]
  timeouts: dict[str, int]
  first_errors: dict[str, str]
  late: dict[str, Late] = dataclasses.field(default_factory=dict)

  @property
  def failure_fraction(self) -> dict[str, float]:
    """name -> fraction of the samples that failed or timed out (0 if none)."""
    n = max(len(self.rewards), 1)
    return {
        name: (self.failures[name] + self.timeouts[name]) / n
        for name in self.per_function
    }

  def metrics(self) -> dict[str, float]:
    """Flat metrics: ``reward/<name>`` means,
    ``reward_{failures,timeouts}/<name>`` counts and
    ``reward_failure_fraction/<name>``."""
    out = {"reward/total": float(self.rewards.mean())}
    fractions = self.failure_fraction
    for name, scores in self.per_function.items():
      out[f"reward/{name}"] = float(scores.mean())
      out[f"reward_failures/{name}"] = float(self.failures[name])
      out[f"reward_timeouts/{name}"] = float(self.timeouts[name])
      out[f"reward_failure_fraction/{name}"] = fractions[name]
    return out


def _one_score(out: Any) -> float:
  """The single finite float a reward returned for one sample, or a ValueError."""
  if isinstance(out, np.ndarray):
    out = out.reshape(-1).tolist() if out.ndim == 1 else out
  if (
      isinstance(out, (str, bytes))
      or not isinstance(out, Sequence)
      or len(out) != 1
  ):
    raise ValueError(
        f"expected a list of one float for one sample, got {out!r}"
    )
  value = float(out[0])
  if not finite_in_float32(value):
    raise ValueError(
        f"non-finite reward {value} in float32 (|r| <= {FLOAT32_MAX:.4g})"
    )
  return value


def _score_samples(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    start: int,
    results: queue.SimpleQueue,
    cancelled: threading.Event,
) -> None:
  """Worker: scores samples ``start, start+1, ...`` one at a time until done or cancelled."""
  for i in range(start, len(completions)):
    if cancelled.is_set():
      return
    try:
      out = fn(
          prompts=[prompts[i]],
          completions=[completions[i]],
          **{k: [v[i]] for k, v in columns.items()},
      )
      results.put((True, _one_score(out)))
    except Exception as e:  # noqa: BLE001 -- any failure of user code scores 0.
      results.put((False, f"{type(e).__name__}: {e}"))


class _Scores(NamedTuple):
  """One function's scores of a batch and what went wrong."""

  scores: np.ndarray
  failures: int
  timeouts: int
  first_error: str | None
  late: float | None  # seconds taken, if the batch deadline passed


def _guarded_scores(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    timeout_s: float,
    batch_timeout_s: float,
) -> _Scores:
  """Scores every sample in a worker thread; a sample past the deadline abandons the worker.

  The abandoned worker is told to stop and exits as soon as the hung call returns; a fresh
  worker resumes at the next sample, so at most one live thread per hung call remains.
  Once ``batch_timeout_s`` have passed, the samples not scored yet are timeouts.
  """
  n = len(completions)
  scores = np.zeros(n, np.float32)
  failures = timeouts = 0
  first_error = None
  start = time.monotonic()
  i = 0
  while i < n:
    left = start + batch_timeout_s - time.monotonic()
    if left <= 0:
      late = time.monotonic() - start
      timeouts += n - i
      first_error = first_error or (
          f"samples {i} to {n - 1}: not scored within the batch deadline of "
          f"{batch_timeout_s:g} s"
      )
      return _Scores(scores, failures, timeouts, first_error, late)
    results: queue.SimpleQueue = queue.SimpleQueue()
    cancelled = threading.Event()
    threading.Thread(
        target=_score_samples,
        args=(fn, prompts, completions, columns, i, results, cancelled),
        name=f"reward-{getattr(fn, '__name__', 'fn')}",
        daemon=True,
    ).start()
    while i < n:
      left = start + batch_timeout_s - time.monotonic()
      try:
        ok, value = results.get(timeout=max(0.0, min(timeout_s, left)))
      except queue.Empty:
        cancelled.set()
        if left > timeout_s:
          timeouts += 1
          first_error = (
              first_error or f"sample {i}: no result within {timeout_s} s"
          )
          i += 1
        break
      if ok:
        scores[i] = value
      else:
        failures += 1
        first_error = first_error or f"sample {i}: {value}"
      i += 1
  return _Scores(scores, failures, timeouts, first_error, None)


def evaluate_rewards(
    fns: Sequence[tuple[RewardFn, float]],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    timeout_s: float = 10.0,
    batch_timeout_s: float = BATCH_TIMEOUT_S,
) -> RewardReport:
  """Weighted rewards of a batch, robust to reward functions that raise or hang.

  Each function scores one sample per call in a worker thread. A sample whose call raises,
  returns something other than one finite number, or takes longer than ``timeout_s`` scores
  0 for that function and is counted in ``failures`` / ``timeouts``; nothing propagates. A
  hung call cannot be interrupted: its daemon thread is abandoned and exits once the call
  returns. A function still scoring after ``batch_timeout_s`` stops there: the samples it
  did not reach are timeouts and its time is in ``late`` (a slow reward bounds the step,
  and is warned about, instead of stalling every batch); a :class:`TimedReward` has a
  deadline of its own.

  Args:
    fns: ``(reward_fn, weight)`` pairs; metrics use each function's
      ``__name__``; weights are finite numbers (negative ones are penalties).
    prompts: ``N`` prompts.
    completions: ``N`` completions.
    columns: column name -> ``N`` values (``answer``, ``entry``, ...), passed as keywords.
    timeout_s: per-sample deadline for each function, in seconds.
    batch_timeout_s: per-batch deadline for each function that is not a
      :class:`TimedReward`, in seconds.

  Returns:
    A :class:`RewardReport`.

  Raises:
    ValueError: when the inputs are misaligned, ``fns`` is empty or a weight
      is not a finite number (caller bugs, not reward failures).

  Example:
    >>> from logra_jax.rl.rewards import exact_match
    >>> report = evaluate_rewards([(exact_match, 1.0)], ["q"], ["12"], {"answer": ["12"]})
    >>> report.rewards, report.failures
    (array([1.], dtype=float32), {'exact_match': 0})
  """
  if not fns:
    raise ValueError(
        "evaluate_rewards needs at least one (reward_fn, weight) pair."
    )
  check_weights(fns)
  if timeout_s <= 0 or batch_timeout_s <= 0:
    raise ValueError(
        f"timeout_s and batch_timeout_s must be > 0, got {timeout_s} and "
        f"{batch_timeout_s}."
    )
  columns = dict(columns or {})
  if len(prompts) != len(completions):
    raise ValueError(
        f"got {len(prompts)} prompts but {len(completions)} completions."
    )
  for column, values in columns.items():
    if len(values) != len(completions):
      raise ValueError(
          f"column {column!r} has {len(values)} values for {len(completions)} completions."
      )
  total = np.zeros(len(completions), np.float32)
  per_function, failures, timeouts, first_errors, late = {}, {}, {}, {}, {}
  for name, (fn, weight) in zip(reward_names([fn for fn, _ in fns]), fns):
    # Each function gets its own copies: one that edits a column (e.g.
    # entry["answer"]) must not change what the others and later batches see.
    deadline = (
        fn.batch_timeout_s if isinstance(fn, TimedReward) else batch_timeout_s
    )
    scores, failed, timed_out, error, seconds = _guarded_scores(
        fn,
        list(prompts),
        list(completions),
        copy.deepcopy(columns),
        timeout_s,
        deadline,
    )
    if seconds is not None:
      late[name] = Late(seconds, deadline)
    per_function[name], failures[name], timeouts[name] = (
        scores,
        failed,
        timed_out,
    )
    weighted, beyond = _weighted(weight, scores)
    if beyond is not None:
      failures[name] += int(np.sum(~np.isfinite(weighted)))
      error = error or beyond
      weighted = np.where(np.isfinite(weighted), weighted, np.float32(0))
    if error is not None:
      first_errors[name] = error
    with np.errstate(over="ignore"):
      total += weighted
  if not np.all(np.isfinite(total)):
    i = int(np.argmin(np.isfinite(total)))
    raise ValueError(
        f"sample {i}: the weighted sum of rewards {list(per_function)} is not "
        f"finite in float32 (|r| <= {FLOAT32_MAX:.4g}); lower their weights"
    )
  return RewardReport(
      rewards=total,
      per_function=per_function,
      failures=failures,
      timeouts=timeouts,
      first_errors=first_errors,
      late=late,
  )


def _weighted(weight: float, scores: np.ndarray) -> tuple[np.ndarray, Any]:
  """``weight * scores`` in float32, and the first sample where it is not
  finite (then a failure of that reward) described, or None."""
  with np.errstate(over="ignore"):
    weighted = np.float32(weight) * scores
  if np.all(np.isfinite(weighted)):
    return weighted, None
  i = int(np.argmin(np.isfinite(weighted)))
  return weighted, (
      f"sample {i}: weight {weight:.4g} x reward {scores[i]:.4g} is not finite in "
      f"float32 (|r| <= {FLOAT32_MAX:.4g})"
  )


class RewardFailureWarnings:
  """Rate-limited warnings for reward functions that fail on most of a batch.

  A reward that fails on every sample (unparseable reference answers, a
  missing column) scores 0 everywhere and the run learns nothing, visible only
  in the metrics. Called on each batch's :class:`RewardReport`, this logs one
  line when a function fails (raises, returns a bad value or times out) on more
  than ``threshold`` of the batch, and one when it ran out of its batch
  deadline (naming its time): the first time, then at most once every
  ``every`` batches per function, counting the batches it held back.

  Args:
    log: where warning lines go (e.g. the trainer's console log).
    threshold: the failure fraction above which a batch is reported, in
      ``[0, 1)``.
    every: the fewest batches between two warnings about one function.

  Example:
    >>> from logra_jax.rl.rewards import math_verify_equivalence
    >>> warn = RewardFailureWarnings(print)
    >>> warn(evaluate_rewards([(math_verify_equivalence, 1.0)], ["q"], ["1"],
    ...                       {"answer": [""]}))  # doctest: +ELLIPSIS
    warning: reward math_verify_equivalence failed on 1 of 1 samples (100%) ...
  """

  def __init__(
      self,
      log: Callable[[str], None] = print,
      *,
      threshold: float = 0.5,
      every: int = 50,
  ):
    if not 0 <= threshold < 1:
      raise ValueError(f"threshold must be in [0, 1), got {threshold}.")
    if every < 1:
      raise ValueError(f"every must be >= 1, got {every}.")
    self._log, self._threshold, self._every = log, threshold, every
    self._batches = 0
    self._last: dict[str, int] = {}  # name -> batch of its last warning
    self._held: dict[str, int] = {}  # name -> bad batches not warned since

  def __call__(self, report: RewardReport) -> None:
    """Logs the functions of ``report`` that failed on too much of the batch."""
    self._batches += 1
    n = len(report.rewards)
    for name, (seconds, deadline) in report.late.items():
      held = self._held_back(f"{name} (late)")
      if held is not None:
        since = f"; {held} more such batch(es) since the last" if held else ""
        self._log(
            f"warning: reward {name} took {seconds:.1f} s on a batch of {n} "
            f"samples and was stopped at its batch deadline of {deadline:g} s "
            f"(rewards.batch_timeout_s); {report.timeouts[name]} sample(s) "
            f"scored 0 as timeouts{since}."
        )
    for name, fraction in report.failure_fraction.items():
      if fraction <= self._threshold:
        continue
      last = self._last.get(name)
      if last is not None and self._batches - last < self._every:
        self._held[name] = self._held.get(name, 0) + 1
        continue
      failed = report.failures[name] + report.timeouts[name]
      line = (
          f"warning: reward {name} failed on {failed} of {n} samples "
          f"({fraction:.0%}) of a batch; first: "
          f"{report.first_errors[name].rstrip('.')}."
      )
      if last is None:
        line += (
            " Check the reward and the task's answers; this warning "
            f"repeats at most every {self._every} batches."
        )
      else:
        held = self._held.pop(name, 0)
        line += (
            f" Since the last warning: {held} more batch"
            f"{'es' if held != 1 else ''} over {self._threshold:.0%}."
        )
      self._last[name] = self._batches
      self._log(line)

  def _held_back(self, key: str) -> int | None:
    """None while a warning about ``key`` is held back (counting it), else
    the batches held back since the last one (now due)."""
    last = self._last.get(key)
    if last is not None and self._batches - last < self._every:
      self._held[key] = self._held.get(key, 0) + 1
      return None
    self._last[key] = self._batches
    return self._held.pop(key, 0)
