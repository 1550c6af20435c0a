"""Reward functions and a guarded evaluator that never lets a bad reward stop training.

A reward function maps a batch to one float per completion::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where each keyword is a task column (``answer``, ``entry``, ...) as a list aligned with the
prompts; functions take ``**columns`` and ignore the ones they do not use. Shipped:
reasoning-gym verification (:func:`reasoning_gym_reward`), math-verify equivalence
(:func:`math_verify_equivalence`), normalized exact match (:func:`exact_match`) and a regex
format reward (:func:`format_reward`); :func:`combine_rewards` weights several into one.
Functions are called with keywords (``fn(prompts=..., completions=..., **columns)``), as TRL
and Tunix call theirs, so their reward functions work unchanged; :func:`load_reward_function`
imports one by ``module:function`` or ``path/to/file.py:function``, and
:func:`check_reward_functions` tries each on a few reference answers before a run compiles.

:func:`evaluate_rewards` runs them sample by sample off the main thread with a per-sample
deadline: a sample whose reward raises, returns a non-number or runs past ``timeout_s`` gets 0
and is counted, and the run goes on. :class:`RewardFailureWarnings` turns a
reward that fails on most of a batch (e.g. unparseable reference answers) into a
rate-limited console warning.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import os
import numbers
import queue
import re
import threading
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


def _check_weights(weighted: Sequence[tuple[RewardFn, Any]]) -> None:
  """Raises a ValueError naming a reward whose weight is not a finite number."""
  for name, (_, weight) in zip(_names([fn for fn, _ in weighted]), weighted):
    if (
        isinstance(weight, bool)
        or not isinstance(weight, numbers.Real)
        or not math.isfinite(weight)
    ):
      raise ValueError(
          f"reward {name!r}: weight must be a finite number, got {weight!r}."
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
  _check_weights(weighted)

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


def load_reward_function(spec: str) -> RewardFn:
  """A reward function by import path or file path.

  Args:
    spec: ``"package.module:function"`` (imported as a module) or
      ``"path/to/file.py:function"`` (loaded from the file, relative to the
      working directory). The function takes
      ``(prompts, completions, **columns)`` as keywords and returns one float
      per completion.

  Returns:
    The function.

  Raises:
    ValueError: a spec without ``:``, a module or file that does not import
      (naming the file and the error), no such attribute, or an attribute
      that is not callable.
    FileNotFoundError: a ``.py`` file that does not exist.

  Example:
    >>> load_reward_function("logra_jax.rl.rewards:exact_match").__name__
    'exact_match'
  """
  where, sep, name = spec.rpartition(":")
  if not sep or not where or not name:
    raise ValueError(
        f"reward {spec!r} must look like package.module:function or "
        "path/to/file.py:function"
    )
  if where.endswith(".py"):
    if not os.path.isfile(where):
      raise FileNotFoundError(f"reward {spec!r}: file {where} not found")
    module_name = "logra_reward_" + os.path.splitext(os.path.basename(where))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, where)
    loader = lambda: _exec_module(module_spec)  # noqa: E731
  else:
    loader = lambda: importlib.import_module(where)  # noqa: E731
  try:
    module = loader()
  except (Exception, SystemExit) as e:  # noqa: BLE001 -- user code's import.
    raise ValueError(
        f"reward {spec!r}: {where} does not import: " f"{type(e).__name__}: {e}"
    ) from e
  fn = getattr(module, name, None)
  if fn is None:
    raise ValueError(f"reward {spec!r}: {where} has no attribute {name!r}")
  if not callable(fn):
    raise ValueError(
        f"reward {spec!r}: {name} is a {type(fn).__name__}, not a function"
    )
  return fn


def _exec_module(module_spec: importlib.machinery.ModuleSpec):
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def check_reward_functions(
    fns: Sequence[tuple[RewardFn, float]],
    examples: Sequence[Mapping[str, Any]],
    *,
    timeout_s: float = 30.0,
) -> None:
  """Tries each reward on the reference answers of ``examples``; raises on a bad one.

  Each function is called once on the whole list (the batch form TRL uses; a
  run scores one sample per call, with the same keywords), with the answers
  as completions: a function that raises, does not take the
  keywords, returns something other than one finite number per completion, or
  runs past ``timeout_s`` is a configuration error, reported before anything
  compiles. Its scores are not judged (a reference answer need not score 1).

  Args:
    fns: ``(reward_fn, weight)`` pairs.
    examples: a few task examples (``prompt``, ``answer`` and other columns).
    timeout_s: the deadline of each call.

  Raises:
    ValueError: naming the function and the problem.

  Example:
    >>> check_reward_functions([(lambda completions, **kw: [1.0], 1.0)],
    ...                        [{"prompt": "1+1=", "answer": "2"}] * 2)
    Traceback (most recent call last):
    ...
    ValueError: reward <lambda> returned 1 values for 2 completions; it must ...
  """
  _check_weights(fns)
  prompts = [e["prompt"] for e in examples]
  completions = [str(e["answer"]) for e in examples]
  columns = {k: [e[k] for e in examples] for k in examples[0] if k != "prompt"}
  for name, (fn, _) in zip(_names([fn for fn, _ in fns]), fns):
    results: queue.SimpleQueue = queue.SimpleQueue()

    def call(fn=fn, results=results):
      try:
        results.put(
            (True, fn(prompts=prompts, completions=completions, **columns))
        )
      except Exception as e:  # noqa: BLE001 -- reported below.
        results.put((False, e))

    threading.Thread(
        target=call, name=f"reward-check-{name}", daemon=True
    ).start()
    try:
      ok, out = results.get(timeout=timeout_s)
    except queue.Empty:
      raise ValueError(
          f"reward {name} returned nothing within {timeout_s} s on "
          f"{len(prompts)} reference answers"
      ) from None
    if not ok:
      signature = _signature(fn)
      raise ValueError(
          f"reward {name}{signature} failed on the task's reference answers: "
          f"{type(out).__name__}: {out}; a reward takes (prompts, completions, "
          f"**columns) as keywords, the columns being {sorted(columns)}"
      ) from out
    if isinstance(out, (str, bytes)) or not isinstance(
        out, (Sequence, np.ndarray)
    ):
      raise ValueError(
          f"reward {name} returned a {type(out).__name__}; it must return "
          "a list with one float per completion."
      )
    if len(out) != len(completions):
      raise ValueError(
          f"reward {name} returned {len(out)} values for {len(completions)} "
          "completions; it must return one float per completion."
      )
    try:
      values = [float(v) for v in out]
    except (TypeError, ValueError):
      raise ValueError(
          f"reward {name} returned {list(out)!r}, not numbers"
      ) from None
    if not all(math.isfinite(v) for v in values):
      raise ValueError(f"reward {name} returned non-finite values {values}")


def _signature(fn: Callable) -> str:
  try:
    return str(inspect.signature(fn))
  except (TypeError, ValueError):
    return ""


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
  """

  rewards: np.ndarray
  per_function: dict[str, np.ndarray]
  failures: dict[str, int]
  timeouts: dict[str, int]
  first_errors: dict[str, str]

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
  if not math.isfinite(value):
    raise ValueError(f"non-finite reward {value}")
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


def _guarded_scores(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    timeout_s: float,
) -> tuple[np.ndarray, int, int, str | None]:
  """Scores every sample in a worker thread; a sample past the deadline abandons the worker.

  The abandoned worker is told to stop and exits as soon as the hung call returns; a fresh
  worker resumes at the next sample, so at most one live thread per hung call remains.
  """
  n = len(completions)
  scores = np.zeros(n, np.float32)
  failures = timeouts = 0
  first_error = None
  i = 0
  while i < n:
    results: queue.SimpleQueue = queue.SimpleQueue()
    cancelled = threading.Event()
    threading.Thread(
        target=_score_samples,
        args=(fn, prompts, completions, columns, i, results, cancelled),
        name=f"reward-{getattr(fn, '__name__', 'fn')}",
        daemon=True,
    ).start()
    while i < n:
      try:
        ok, value = results.get(timeout=timeout_s)
      except queue.Empty:
        cancelled.set()
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
  return scores, failures, timeouts, first_error


def _names(fns: Sequence[RewardFn]) -> list[str]:
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


def evaluate_rewards(
    fns: Sequence[tuple[RewardFn, float]],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    timeout_s: float = 10.0,
) -> RewardReport:
  """Weighted rewards of a batch, robust to reward functions that raise or hang.

  Each function scores one sample per call in a worker thread. A sample whose call raises,
  returns something other than one finite number, or takes longer than ``timeout_s`` scores
  0 for that function and is counted in ``failures`` / ``timeouts``; nothing propagates. A
  hung call cannot be interrupted: its daemon thread is abandoned and exits once the call
  returns.

  Args:
    fns: ``(reward_fn, weight)`` pairs; metrics use each function's
      ``__name__``; weights are finite numbers (negative ones are penalties).
    prompts: ``N`` prompts.
    completions: ``N`` completions.
    columns: column name -> ``N`` values (``answer``, ``entry``, ...), passed as keywords.
    timeout_s: per-sample deadline for each function, in seconds.

  Returns:
    A :class:`RewardReport`.

  Raises:
    ValueError: when the inputs are misaligned, ``fns`` is empty or a weight
      is not a finite number (caller bugs, not reward failures).

  Example:
    >>> report = evaluate_rewards([(exact_match, 1.0)], ["q"], ["12"], {"answer": ["12"]})
    >>> report.rewards, report.failures
    (array([1.], dtype=float32), {'exact_match': 0})
  """
  if not fns:
    raise ValueError(
        "evaluate_rewards needs at least one (reward_fn, weight) pair."
    )
  _check_weights(fns)
  if timeout_s <= 0:
    raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
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
  per_function, failures, timeouts, first_errors = {}, {}, {}, {}
  for name, (fn, weight) in zip(_names([fn for fn, _ in fns]), fns):
    scores, failed, timed_out, error = _guarded_scores(
        fn, prompts, completions, columns, timeout_s
    )
    per_function[name], failures[name], timeouts[name] = (
        scores,
        failed,
        timed_out,
    )
    if error is not None:
      first_errors[name] = error
    total += np.float32(weight) * scores
  return RewardReport(
      rewards=total,
      per_function=per_function,
      failures=failures,
      timeouts=timeouts,
      first_errors=first_errors,
  )


class RewardFailureWarnings:
  """Rate-limited warnings for reward functions that fail on most of a batch.

  A reward that fails on every sample (unparseable reference answers, a
  missing column) scores 0 everywhere and the run learns nothing, visible only
  in the metrics. Called on each batch's :class:`RewardReport`, this logs one
  line when a function fails (raises, returns a bad value or times out) on more
  than ``threshold`` of the batch: the first time, then at most once every
  ``every`` batches per function, counting the batches it held back.

  Args:
    log: where warning lines go (e.g. the trainer's console log).
    threshold: the failure fraction above which a batch is reported, in
      ``[0, 1)``.
    every: the fewest batches between two warnings about one function.

  Example:
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
