"""Tasks: lists of ``{"prompt", "answer", ...columns}`` examples with deterministic splits.

Three sources:

* reasoning-gym procedural generators by name and config (:func:`reasoning_gym_task`); each
  example keeps the generator's ``entry`` (question, answer, metadata) so the generator's own
  ``score_answer`` can verify completions;
* local JSONL / JSON / parquet files read with ``datasets`` (:func:`file_task`), with
  configurable columns, a prompt template and GSM8K-style answer extraction;
* the tiny CPU default (:func:`tiny_arithmetic_task`): reasoning-gym ``chain_sum`` with
  compact prompts such as ``"12+7-3="`` and answers such as ``"16"``.

Extra columns of an example are passed to reward functions as keyword lists (see
``logra_jax.rl.rewards``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import datasets
import numpy as np
import pyarrow.parquet
import reasoning_gym

Example = dict[str, Any]
ScoreAnswer = Callable[[str | None, Mapping[str, Any]], float]

TINY_TASK = "tiny_arithmetic"
TINY_CHAIN_SUM_CONFIG: Mapping[str, int] = {
    "min_terms": 2,
    "max_terms": 3,
    "min_digits": 1,
    "max_digits": 2,
}
FILE_BUILDERS: Mapping[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


@dataclasses.dataclass(frozen=True)
class Task:
  """A named, non-empty list of examples and, for reasoning-gym tasks, their verifier.

  Attributes:
    name: the task's name (reasoning-gym dataset name, file stem or :data:`TINY_TASK`).
    examples: dicts with at least ``"prompt"`` and ``"answer"`` strings; reasoning-gym
      examples also hold ``"entry"``, the generator's item for ``score_answer``.
    score_answer: ``(completion, entry) -> float`` in ``[0, 1]`` from the configured
      reasoning-gym generator; ``None`` for file tasks (use a reward such as math-verify).
  """

  name: str
  examples: tuple[Example, ...]
  score_answer: ScoreAnswer | None = None

  def __post_init__(self):
    if not self.examples:
      raise ValueError(f"task {self.name!r} has no examples (empty dataset).")

  def __len__(self) -> int:
    return len(self.examples)

  def split(
      self, eval_size: int, seed: int = 0
  ) -> tuple[list[Example], list[Example]]:
    """Deterministic train / eval split, disjoint by prompt text.

    The distinct prompts are shuffled with ``seed``; the first ``eval_size`` form the eval
    set (one example each) and every example of any other prompt is in train, so no eval
    prompt is ever trained on, even when the source repeats prompts.

    Args:
      eval_size: number of eval examples (distinct prompts), at least 1.
      seed: shuffling seed; the same seed gives the same split.

    Returns:
      ``(train_examples, eval_examples)``.

    Example:
      >>> train, evals = tiny_arithmetic_task(size=100).split(eval_size=10, seed=0)
      >>> len(evals), {e["prompt"] for e in train} & {e["prompt"] for e in evals}
      (10, set())
    """
    first_by_prompt: dict[str, int] = {}
    for i, example in enumerate(self.examples):
      first_by_prompt.setdefault(example["prompt"], i)
    prompts = list(first_by_prompt)
    if not 1 <= eval_size < len(prompts):
      raise ValueError(
          f"eval_size={eval_size} must be in [1, {len(prompts) - 1}]: task {self.name!r} has "
          f"{len(prompts)} distinct prompts and train needs at least one."
      )
    order = np.random.default_rng(seed).permutation(len(prompts))
    eval_prompts = {prompts[i] for i in order[:eval_size]}
    evals = [
        self.examples[first_by_prompt[prompts[i]]] for i in order[:eval_size]
    ]
    train = [e for e in self.examples if e["prompt"] not in eval_prompts]
    return train, evals

  def splits(
      self, validation_size: int, test_size: int, seed: int = 0
  ) -> tuple[list[Example], list[Example], list[Example]]:
    """Train, validation and test splits, pairwise disjoint by prompt text.

    The held-out prompts are those of ``split(validation_size + test_size,
    seed)``, in its shuffled order: the first ``validation_size`` form the
    validation set (for choosing settings such as learning rates), the rest
    the test set (for reported numbers only). So a run configured with
    ``task.eval_size = validation_size + test_size`` and ``task.seed = seed``
    trains on exactly the returned train split.

    Args:
      validation_size: validation examples (distinct prompts), at least 1.
      test_size: test examples (distinct prompts), at least 1.
      seed: shuffling seed, as in :meth:`split`.

    Returns:
      ``(train_examples, validation_examples, test_examples)``.

    Example:
      >>> train, val, test = tiny_arithmetic_task(size=200).splits(10, 20)
      >>> len(val), len(test), {e["prompt"] for e in val} & {
      ...     e["prompt"] for e in test}
      (10, 20, set())
    """
    if validation_size < 1 or test_size < 1:
      raise ValueError(
          f"validation_size={validation_size} and test_size={test_size} must "
          "both be >= 1."
      )
    train, held_out = self.split(validation_size + test_size, seed=seed)
    return train, held_out[:validation_size], held_out[validation_size:]

  def distinct_prompts(self) -> int:
    """The number of distinct prompt texts (the most examples a split holds
    out is one less).

    Example:
      >>> Task("t", ({"prompt": "a", "answer": "1"},) * 3).distinct_prompts()
      1
    """
    return len({e["prompt"] for e in self.examples})


def _format(template: str, fields: Mapping[str, Any], source: str) -> str:
  """``template.format(**fields)`` with a one-line error naming a missing
  field and the valid ones, or what else the template cannot format (a
  position such as ``{0}``, an attribute or index the field lacks)."""
  try:
    return template.format(**fields)
  except KeyError as e:
    raise ValueError(
        f"prompt template {template!r} uses field {e.args[0]!r}, which {source} lacks; "
        f"available fields: {sorted(fields)}."
    ) from None
  except (IndexError, AttributeError, TypeError, ValueError) as e:
    raise ValueError(
        f"prompt template {template!r} cannot format {source}: "
        f"{type(e).__name__}: {e}; use named fields such as {{prompt}}."
    ) from None


def reasoning_gym_task(
    name: str,
    *,
    size: int = 1000,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    template: str | Callable[[Mapping[str, Any]], str] = "{question}",
) -> Task:
  """A reasoning-gym procedural task, verified by the generator's own ``score_answer``.

  Args:
    name: a reasoning-gym dataset name, e.g. ``"chain_sum"``, ``"basic_arithmetic"``; all
      names: ``sorted(reasoning_gym.factory.DATASETS)``.
    size: number of generated examples.
    seed: generator seed (items are a deterministic function of seed and index).
    config: the generator's config fields (e.g. ``{"min_terms": 2}`` for ``chain_sum``).
    template: the prompt, as a format string over the item's fields and its metadata's
      fields, ``{prompt}`` being the question (``"{question}"`` by default;
      ``"{expression} ="`` for arithmetic), or a callable from the item to the prompt.

  Returns:
    A :class:`Task` whose examples are ``{"prompt", "answer", "entry"}``.

  Example:
    >>> task = reasoning_gym_task("chain_sum", size=8, config={"max_terms": 3})
    >>> task.score_answer(task.examples[0]["answer"], task.examples[0]["entry"])
    1.0
  """
  if name not in reasoning_gym.factory.DATASETS:
    valid = sorted(reasoning_gym.factory.DATASETS)
    close = difflib.get_close_matches(name, valid, n=3)
    hint = f" Did you mean {close}?" if close else ""
    raise ValueError(
        f"unknown task {name!r}.{hint} Valid names: {TINY_TASK!r}, a .jsonl/.json/.parquet file, "
        f"or one of the {len(valid)} reasoning-gym datasets, e.g. {valid[:8]} (all: "
        "sorted(reasoning_gym.factory.DATASETS))."
    )
  if size < 1:
    raise ValueError(
        f"task {name!r}: size must be >= 1 (empty dataset), got {size}."
    )
  config = dict(config or {})
  config_cls = reasoning_gym.factory.DATASETS[name][1]
  fields = sorted(
      f.name
      for f in dataclasses.fields(config_cls)
      if f.name not in ("seed", "size")
  )
  unknown = sorted(set(config) - set(fields))
  if unknown:
    raise ValueError(
        f"unknown config fields {unknown} for {name!r}; valid fields: {fields}."
    )
  try:
    generator = reasoning_gym.create_dataset(
        name, size=size, seed=seed, **config
    )
  except (AssertionError, TypeError, ValueError) as e:
    raise ValueError(
        f"invalid config {config} for {name!r}: {type(e).__name__}: {e}"
    ) from None
  examples = []
  for i in range(size):
    entry = _generate(generator, i, name, config)
    if callable(template):
      prompt = template(entry)
    else:
      prompt = _format(
          template,
          {**entry.get("metadata", {}), **entry, "prompt": entry["question"]},
          f"{name!r} items",
      )
    examples.append(
        {"prompt": prompt, "answer": str(entry["answer"]), "entry": entry}
    )
  return Task(
      name=name, examples=tuple(examples), score_answer=generator.score_answer
  )


def _generate(generator: Any, i: int, name: str, config: Mapping) -> dict:
  """Item ``i`` of a reasoning-gym generator; a config it cannot generate
  from (a value of the wrong type) is a one-line ValueError."""
  try:
    return generator[i]
  except (AssertionError, TypeError, ValueError, IndexError) as e:
    raise ValueError(
        f"invalid config {config} for {name!r}: item {i} cannot be generated"
        f" ({type(e).__name__}: {e})"
    ) from None


def _is_empty_file(path: str) -> bool:
  """Whether a parquet file has no rows, or a JSON(L) file holds only whitespace or ``[]``."""
  if path.lower().endswith(".parquet"):
    return pyarrow.parquet.ParquetFile(path).metadata.num_rows == 0
  with open(path, encoding="utf-8") as f:
    return f.read(4096).strip() in ("", "[]")


def _json_lines_problem(lines: Sequence[str]) -> str | None:
  """Where and why JSON lines are not one JSON object each, or None."""
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      return f"line {number}: not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(row, dict):
      return (
          f"line {number}: a JSON {type(row).__name__}, not a JSON "
          "object (one row per line)"
      )
  return None


def _json_problem(path: str) -> str | None:
  """The line and reason of a JSON or JSON Lines syntax error, or None.

  A ``.json`` file may hold one document (an array of rows) or JSON lines, as
  ``datasets`` accepts; it is read as lines when its first line is a row.
  """
  with open(path, encoding="utf-8") as f:
    text = f.read()
  lines = text.splitlines()
  if path.lower().endswith(".json"):
    try:
      json.loads(text)
      return None
    except json.JSONDecodeError as e:
      first_row = [line for line in lines if line.strip()][:1]
      if _json_lines_problem(first_row) is not None:
        return f"line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
  return _json_lines_problem(lines)


def _load_rows(builder: str, path: str) -> datasets.Dataset | None:
  """The rows of one file, None if it has none; a one-line error names it."""
  try:
    if _is_empty_file(path):
      return None
    problem = _json_problem(path) if builder == "json" else None
    if problem is None:
      return datasets.load_dataset(builder, data_files=[path], split="train")
  except Exception as e:  # noqa: BLE001 -- pyarrow, pandas, datasets errors.
    root = e
    while root.__cause__ or root.__context__:
      root = root.__cause__ or root.__context__
    reason = (str(root).strip().splitlines() or [""])[0]
    raise ValueError(
        f"cannot read {path}: {type(root).__name__}: {reason}"
    ) from e
  raise ValueError(f"{path}, {problem}.")


def file_task(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    prompt_column: str = "question",
    answer_column: str = "answer",
    template: str = "{prompt}",
    answer_after: str | None = None,
    name: str | None = None,
) -> Task:
  r"""A task from local JSONL / JSON / parquet files, read with ``datasets.load_dataset``.

  Every row becomes ``{**row, "prompt": ..., "answer": ...}``; the other columns are kept
  (reward functions receive them). Bad input is a one-line ``ValueError``
  naming the file and the line (from 1) of a JSON syntax error, or the row
  (from 0) of a null or missing prompt or answer.

  Args:
    data_files: one path or a list of paths, all with the same extension (``.jsonl``,
      ``.json`` or ``.parquet``).
    prompt_column: the column holding the question text.
    answer_column: the column holding the reference answer.
    template: format string for the prompt: ``{prompt}`` is the prompt column and any other
      ``{column}`` is that row's value, e.g. ``"Question: {question}\nAnswer:"``.
    answer_after: if set, the answer is the stripped text after the last occurrence of this
      marker (GSM8K: ``"#### "``); rows without it are an error.
    name: task name; defaults to the first file's stem.

  Returns:
    A :class:`Task` without ``score_answer``.

  Example:
    >>> task = file_task("gsm8k.jsonl", template="Question: {question}\nAnswer:",
    ...                  answer_after="#### ")   # doctest: +SKIP
  """
  paths = (
      [os.fspath(data_files)]
      if isinstance(data_files, (str, os.PathLike))
      else [os.fspath(p) for p in data_files]
  )
  if not paths:
    raise ValueError("file_task needs at least one data file, got none.")
  extensions = {os.path.splitext(p)[1].lower() for p in paths}
  if len(extensions) != 1 or next(iter(extensions)) not in FILE_BUILDERS:
    raise ValueError(
        f"data files {paths} must share one extension among {sorted(FILE_BUILDERS)}; "
        f"got {sorted(extensions)}."
    )
  missing_files = [p for p in paths if not os.path.isfile(p)]
  if missing_files:
    raise FileNotFoundError(f"data files not found: {missing_files}.")
  name = name or os.path.splitext(os.path.basename(paths[0]))[0]
  builder = FILE_BUILDERS[extensions.pop()]
  examples = []
  for path in paths:
    rows = _load_rows(builder, path)
    if rows is not None:
      examples += _file_examples(
          path, rows, prompt_column, answer_column, template, answer_after
      )
  if not examples:
    raise ValueError(
        f"task {name!r}: data files {paths} hold no rows (empty dataset)."
    )
  return Task(name=name, examples=tuple(examples))


def _file_examples(
    path: str,
    rows: datasets.Dataset,
    prompt_column: str,
    answer_column: str,
    template: str,
    answer_after: str | None,
) -> list[Example]:
  """The examples of one file's rows; errors name the file and the row."""
  for role, column in (
      ("prompt_column", prompt_column),
      ("answer_column", answer_column),
  ):
    if column not in rows.column_names:
      raise ValueError(
          f"{role}={column!r} is not a column of {path}; available columns: "
          f"{rows.column_names}."
      )
  examples = []
  for i, row in enumerate(rows):
    for role, column in (("prompt", prompt_column), ("answer", answer_column)):
      if row[column] is None:
        raise ValueError(
            f"{path}, row {i}: column {column!r} is null or missing; every "
            f"row needs its {role}."
        )
    where = f"{path}, row {i}"
    prompt = _format(template, {**row, "prompt": row[prompt_column]}, where)
    answer = str(row[answer_column])
    if answer_after is not None:
      if answer_after not in answer:
        raise ValueError(
            f"{where}: answer {answer!r} has no marker {answer_after!r} "
            "(answer_after)."
        )
      answer = answer.rsplit(answer_after, 1)[1].strip()
    examples.append({**row, "prompt": prompt, "answer": answer})
  return examples


def compact_expression_prompt(entry: Mapping[str, Any]) -> str:
  """The tiny task's prompt: the item's arithmetic expression without spaces, then ``=``.

  Example:
    >>> compact_expression_prompt({"metadata": {"expression": "12 + 7 - 3"}})
    '12+7-3='
  """
  return entry["metadata"]["expression"].replace(" ", "") + "="


def tiny_arithmetic_task(
    *,
    size: int = 2000,
    seed: int = 0,
    template: str = "{prompt}",
    **config: int,
) -> Task:
  """The tiny CPU default: short sums and differences, verified by reasoning-gym.

  reasoning-gym ``chain_sum`` with 2-3 terms of 1-2 digits (:data:`TINY_CHAIN_SUM_CONFIG`,
  overridable through ``config``), prompts such as ``"12+7-3="`` and answers such as
  ``"16"`` (possibly negative): prompt plus answer is 5 to 13 characters (about 8), so it fits a
  character-level model with a 128-token context.

  Args:
    size: number of generated examples (the 1-digit two-term items repeat; splits are
      disjoint by prompt anyway).
    seed: generator seed.
    template: the prompt as a format string, ``{prompt}`` being the compact expression
      (e.g. ``"Q: {prompt}"``); other fields as in :func:`reasoning_gym_task`.
    **config: overrides of ``chain_sum`` config fields.

  Returns:
    A :class:`Task` named :data:`TINY_TASK`, scored by ``chain_sum``'s ``score_answer``.

  Example:
    >>> example = tiny_arithmetic_task(size=4).examples[3]
    >>> example["prompt"], example["answer"]
    ('5-9=', '-4')
  """

  def prompt(entry: Mapping[str, Any]) -> str:
    return _format(
        template,
        {
            **entry.get("metadata", {}),
            **entry,
            "prompt": compact_expression_prompt(entry),
        },
        "tiny items",
    )

  task = reasoning_gym_task(
      "chain_sum",
      size=size,
      seed=seed,
      config={**TINY_CHAIN_SUM_CONFIG, **config},
      template=prompt,
  )
  return dataclasses.replace(task, name=TINY_TASK)


def worked_answers(
    examples: Sequence[Example], separator: str = ""
) -> list[str]:
  """Supervised warm-start texts: each prompt followed by its answer.

  Args:
    examples: task examples.
    separator: text between prompt and answer (``""`` for the tiny task, whose prompts end
      with ``=``; e.g. ``" "`` after ``"Answer:"``).

  Returns:
    ``prompt + separator + answer`` per example, e.g. ``"12+7-3=16"``.

  Example:
    >>> worked_answers([{"prompt": "12+7-3=", "answer": "16"}])
    ['12+7-3=16']
  """
  return [f"{e['prompt']}{separator}{e['answer']}" for e in examples]


def load_task(name: str, **kwargs: Any) -> Task:
  """A task by name: :data:`TINY_TASK` (or ``"tiny"``), a data file path, or a reasoning-gym name.

  Args:
    name: ``"tiny"``/``"tiny_arithmetic"``, a path ending in ``.jsonl``, ``.json`` or
      ``.parquet``, or a reasoning-gym dataset name.
    **kwargs: passed to :func:`tiny_arithmetic_task`, :func:`file_task` or
      :func:`reasoning_gym_task`.

  Returns:
    The :class:`Task`.

  Example:
    >>> load_task("chain_sum", size=4, config={"max_terms": 2}).name
    'chain_sum'
  """
  if name in ("tiny", TINY_TASK):
    return tiny_arithmetic_task(**kwargs)
  if os.path.splitext(name)[1].lower() in FILE_BUILDERS:
    return file_task(name, **kwargs)
  return reasoning_gym_task(name, **kwargs)


def prompt_batches(
    examples: Sequence[Example], batch_size: int, *, seed: int = 0
) -> Iterator[list[Example]]:
  """Endless full batches of examples, reshuffled every epoch, deterministic in ``seed``.

  Batches run across epoch boundaries so every batch has exactly ``batch_size`` examples
  (fixed shapes for the jitted rollout).

  Args:
    examples: the examples to draw from (e.g. a train split).
    batch_size: examples per batch.
    seed: shuffling seed.

  Yields:
    Lists of ``batch_size`` examples.

  Example:
    >>> it = prompt_batches([{"prompt": "1+1=", "answer": "2"}] * 3, 2)
    >>> len(next(it)), len(next(it))
    (2, 2)
  """
  if not examples:
    raise ValueError(
        "prompt_batches needs at least one example, got an empty list."
    )
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  rng = np.random.default_rng(seed)
  batch: list[Example] = []
  while True:
    for i in rng.permutation(len(examples)):
      batch.append(examples[i])
      if len(batch) == batch_size:
        yield batch
        batch = []
