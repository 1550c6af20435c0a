"""Where a run's numbers and samples go besides ``metrics.jsonl``: trackers
(TensorBoard, Weights & Biases), tables of sampled completions and counts of
XLA compilations.

TensorBoard events are written by ``tensorboardX``'s event-file writer in
the caller's thread, one flushed event per step (a failed write, a full
disk, raises at once; ``SummaryWriter``'s writer thread would die and leave
the run blocked on its full queue); W&B is ``wandb.init``/``log``.
:func:`check_trackers` refuses a tracker whose library is missing before a
run starts. A sample table shows the first
completion of a few prompts of a batch with its reward, on the console
(rendered by ``rich``) and as JSON lines in ``samples.jsonl``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import pathlib
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import rich.console
import rich.table
from tensorboardX import event_file_writer
from tensorboardX import summary as tensorboard_summary
from tensorboardX.proto import event_pb2

from logra_jax.rl import scoring

# tracker -> (the module it needs, what installs it)
_LIBRARIES = {
    "tensorboard": ("tensorboardX", "tensorboardX"),
    "wandb": ("wandb", "'logra-jax[wandb]'"),
}


# What JAX reports once per XLA compilation, with the jitted function's name.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compilations:
  """Counts the XLA compilations of this process while open (a context
  manager), from JAX's monitoring events: a train step compiled again for
  each new batch shape shows here.

  :meth:`metrics` gives ``compile/train_step`` (programs compiled of the
  learner's train step), ``compile/count`` (all programs) and
  ``compile/seconds`` (their XLA compile time).

  Example:
    >>> import jax.numpy as jnp
    >>> with Compilations() as compiled:
    ...   train_step = jax.jit(lambda x: 2 * x)
    ...   _ = train_step(jnp.ones(3)), train_step(jnp.ones(4))
    >>> compiled.metrics()["compile/count"] >= 2
    True
  """

  def __init__(self):
    self._lock = threading.Lock()  # the rollout thread compiles too
    self._count = self._train_step = 0
    self._seconds = 0.0

  def _observe(self, event: str, seconds: float, **kwargs) -> None:
    if event != _COMPILE_EVENT:
      return
    with self._lock:
      self._count += 1
      self._seconds += seconds
      self._train_step += "train_step" in kwargs.get("fun_name", "")

  def __enter__(self) -> "Compilations":
    jax.monitoring.register_event_duration_secs_listener(self._observe)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._observe)

  def metrics(self) -> dict[str, float]:
    """The counts so far."""
    with self._lock:
      return {
          "compile/train_step": float(self._train_step),
          "compile/count": float(self._count),
          "compile/seconds": self._seconds,
      }


def check_trackers(names: Sequence[str]) -> None:
  """Raises a ValueError naming a tracker whose library is not installed,
  and how to install it."""
  for name in names:
    module, requirement = _LIBRARIES[name]
    if importlib.util.find_spec(module) is None:
      raise ValueError(
          f"logging.trackers includes {name!r}, but {module} is not "
          f"installed: pip install {requirement}"
      )


class TensorboardEvents:
  """One TensorBoard event file under ``folder``, written synchronously.

  Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...   events = TensorboardEvents(pathlib.Path(out) / "tensorboard")
    ...   events.log({"reward/total": 0.5}, step=1)
    ...   events.close()
  """

  def __init__(self, folder: pathlib.Path):
    folder.mkdir(parents=True, exist_ok=True)
    self._writer = event_file_writer.EventsWriter(str(folder / "events"))

  def log(self, metrics: Mapping[str, float], step: int) -> None:
    """Appends one event holding ``metrics`` as scalars and flushes it."""
    values = [
        value
        for name, number in metrics.items()
        for value in tensorboard_summary.scalar(name, float(number)).value
    ]
    event = event_pb2.Event(wall_time=time.time(), step=step)
    event.summary.value.extend(values)
    self._writer.write_event(event)
    self._writer.flush()

  def close(self) -> None:
    """Closes the file."""
    self._writer.close()


class Trackers:
  """The run's trackers, each given every step's metrics.

  Args:
    names: ``logging.trackers``.
    out: the run folder (TensorBoard writes under ``out/tensorboard``;
      W&B keeps its files under ``out/wandb`` and its run id in
      ``out/wandb-run-id``).
    config: the run's config as plain dicts, recorded by W&B.
    resume: the run resumes: W&B continues the run of ``wandb-run-id``
      (otherwise a new W&B run is started).

  Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...   with Trackers(["tensorboard"], pathlib.Path(out), {}) as trackers:
    ...     trackers.log({"reward/total": 0.5}, step=1)
  """

  def __init__(
      self,
      names: Sequence[str],
      out: pathlib.Path,
      config: Mapping[str, Any],
      resume: bool = False,
  ):
    check_trackers(names)
    self._tensorboard = self._wandb = None
    if "tensorboard" in names:
      self._tensorboard = TensorboardEvents(out / "tensorboard")
    if "wandb" in names:
      import wandb

      id_file = out / "wandb-run-id"
      if not resume or not id_file.exists():  # a new run: a new W&B run
        id_file.write_text(uuid.uuid4().hex[:16])
      self._wandb = wandb.init(
          dir=str(out),
          name=out.name,
          id=id_file.read_text().strip(),
          resume="allow",
          config=dict(config),
      )

  def log(self, metrics: Mapping[str, float], step: int) -> None:
    """Records one step's metrics."""
    if self._tensorboard is not None:
      self._tensorboard.log(metrics, step)
    if self._wandb is not None:
      self._wandb.log(dict(metrics), step=step)

  def close(self) -> None:
    """Flushes and closes every tracker."""
    if self._tensorboard is not None:
      self._tensorboard.close()
    if self._wandb is not None:
      self._wandb.finish()

  def __enter__(self) -> "Trackers":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def samples_due(step: int, every: int) -> bool:
  """Whether step ``step`` (from 1) shows a sample table: the first step,
  then every ``every`` steps (``logging.samples_every``; 0: never).

  Example:
    >>> [s for s in range(1, 12) if samples_due(s, 5)]
    [1, 5, 10]
  """
  return bool(every) and (step == 1 or step % every == 0)


def sample_rows(
    samples: scoring.RolloutSamples, num_generations: int, shown: int
) -> list[dict[str, Any]]:
  """The first completion of each of the first ``shown`` prompts: its
  prompt, completion, reference answer (when the task has one), total
  reward and each reward function's score.

  Example:
    >>> from logra_jax.rl import rewards
    >>> report = rewards.evaluate_rewards([(rewards.exact_match, 1.0)],
    ...     ["1+1=", "1+1="], ["2", "3"], {"answer": ["2", "2"]})
    >>> samples = scoring.RolloutSamples(["1+1=", "1+1="], ["2", "3"],
    ...                                     {"answer": ["2", "2"]}, report)
    >>> sample_rows(samples, num_generations=2, shown=4)
    [{'prompt': '1+1=', 'completion': '2', 'answer': '2', 'reward': 1.0, 'reward/exact_match': 1.0}]
  """
  rows = []
  for i in range(0, len(samples.completions), num_generations)[:shown]:
    row = {"prompt": samples.prompts[i], "completion": samples.completions[i]}
    if "answer" in samples.columns:
      row["answer"] = str(samples.columns["answer"][i])
    row["reward"] = float(samples.report.rewards[i])
    for name, scores in samples.report.per_function.items():
      row[f"reward/{name}"] = float(np.asarray(scores)[i])
    rows.append(row)
  return rows


def sample_table(
    rows: Sequence[Mapping[str, Any]], step: int, width: int = 100
) -> str:
  """``rows`` (:func:`sample_rows`) as a text table titled with the step."""
  table = rich.table.Table(title=f"samples at step {step}", show_lines=True)
  columns = [
      c
      for c in ("prompt", "completion", "answer", "reward")
      if rows and c in rows[0]
  ]
  for column in columns:
    table.add_column(
        column,
        overflow="fold",
        justify="right" if column == "reward" else "left",
    )
  for row in rows:
    table.add_row(
        *(f"{row[c]:.3f}" if c == "reward" else str(row[c]) for c in columns)
    )
  console = rich.console.Console(
      file=io.StringIO(), width=width, color_system=None
  )
  console.print(table)
  return console.file.getvalue().rstrip("\n")


class SampleLog:
  """Appends sample rows to ``samples.jsonl``, one JSON object per row with
  its ``step``; opened for a resumed run, it first drops the rows of steps
  after ``resumed_step`` (they are sampled again).

  Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...   path = pathlib.Path(out) / "samples.jsonl"
    ...   with SampleLog(path) as log:
    ...     log.write(3, [{"prompt": "1+1=", "completion": "2"}])
    ...   with SampleLog(path, resumed_step=2) as log:
    ...     pass
    ...   path.read_text()
    ''
  """

  def __init__(self, path: pathlib.Path, resumed_step: int | None = None):
    kept = []
    if resumed_step is not None and path.exists():
      for line in path.read_text(encoding="utf-8").splitlines():
        try:
          row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
          continue
        if isinstance(row, dict) and row.get("step", 0) <= resumed_step:
          kept.append(line)
    self._file = open(path, "w", encoding="utf-8")
    self._file.writelines(line + "\n" for line in kept)
    self._file.flush()

  def write(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
    for row in rows:
      self._file.write(json.dumps({"step": step, **row}) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()

  def __enter__(self) -> "SampleLog":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
