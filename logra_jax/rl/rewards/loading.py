"""Reward functions by import or file path, tried on reference answers.

:func:`load_reward_function` imports one by ``module:function`` or
``path/to/file.py:function``; :func:`check_reward_functions` tries each on a
few reference answers before a run compiles, so that a bad one fails first.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from logra_jax.deadlines import call_bounded
from logra_jax.rl.rewards.builtin import FLOAT32_MAX
from logra_jax.rl.rewards.builtin import check_weights
from logra_jax.rl.rewards.builtin import finite_in_float32
from logra_jax.rl.rewards.builtin import reward_names
from logra_jax.rl.rewards.builtin import RewardFn


def load_reward_function(spec: str, *, timeout_s: float = 30.0) -> RewardFn:
  """A reward function by import path or file path.

  Args:
    spec: ``"package.module:function"`` (imported as a module) or
      ``"path/to/file.py:function"`` (loaded from the file, relative to the
      working directory). The function takes
      ``(prompts, completions, **columns)`` as keywords and returns one float
      per completion.
    timeout_s: the deadline of the import (the same as each call's in
      :func:`check_reward_functions`): a module that blocks while it
      imports is refused, not waited for.

  Returns:
    The function.

  Raises:
    ValueError: a spec without ``:``, a module or file that does not import
      (naming the file and the error) or not within ``timeout_s``, no such
      attribute, or an attribute that is not callable.
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
    module = call_bounded(loader, timeout_s, f"reward-import-{name}")
  except TimeoutError:
    raise ValueError(
        f"reward {spec!r}: {where} did not finish importing within "
        f"{timeout_s:g} s"
    ) from None
  except (Exception, SystemExit) as e:  # noqa: BLE001 -- user code's import.
    raise ValueError(
        f"reward {spec!r}: {where} does not import: {type(e).__name__}: {e}"
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
  check_weights(fns)
  prompts = [e["prompt"] for e in examples]
  completions = [str(e["answer"]) for e in examples]
  columns = {k: [e[k] for e in examples] for k in examples[0] if k != "prompt"}
  for name, (fn, _) in zip(reward_names([fn for fn, _ in fns]), fns):
    try:
      out = call_bounded(
          lambda fn=fn: fn(prompts=prompts, completions=completions, **columns),
          timeout_s,
          f"reward-check-{name}",
      )
    except TimeoutError:
      raise ValueError(
          f"reward {name} returned nothing within {timeout_s} s on "
          f"{len(prompts)} reference answers"
      ) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- user code.
      raise ValueError(
          f"reward {name}{_signature(fn)} failed on the task's reference "
          f"answers: {type(e).__name__}: {e}; a reward takes (prompts, "
          f"completions, **columns) as keywords, the columns being "
          f"{sorted(columns)}"
      ) from e
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
    if not all(finite_in_float32(v) for v in values):
      raise ValueError(
          f"reward {name} returned values not finite in float32 (|r| <= "
          f"{FLOAT32_MAX:.4g}, the dtype rewards are used in): {values}"
      )


def _signature(fn: Callable) -> str:
  try:
    return str(inspect.signature(fn))
  except (TypeError, ValueError):
    return ""
