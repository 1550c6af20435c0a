"""The run log: each step's metrics in ``metrics.jsonl``, the trackers,
``samples.jsonl`` and its tables, reward warnings, the progress bar, and the
history of every step's metrics that checkpoints keep."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from typing import Any, Callable, Iterator, Optional

import numpy as np
import tqdm

from logra_jax.configs import TrainConfig, to_dict
from logra_jax.rl import rewards as rewards_lib
from logra_jax.rl import scoring
from logra_jax.rl import tracking
from logra_jax.rl.learner_state import Update
from logra_jax.rl.reporting import REALIZED

Log = Callable[[str], None]


def step_times(
    step_start: float, rollout_seconds: float, sync_seconds: float
) -> dict[str, float]:
  """A step's seconds: the rollout's (sampling, scoring, placing the batch),
  the whole step's and the learner's (the rest, less a synchronous sync's).

  Example:
    >>> times = step_times(time.perf_counter(), 0.0, 0.0)
    >>> times["time/train_s"] == times["time/step_s"]
    True
  """
  step_seconds = time.perf_counter() - step_start
  return {
      "time/rollout_s": rollout_seconds,
      "time/step_s": step_seconds,
      "time/train_s": step_seconds - rollout_seconds - sync_seconds,
  }


class RunLog:
  """Where a run's steps are recorded, while open (a context manager).

  Args:
    config: the run's config.
    out: the run's folder.
    history: the metrics of the steps before (a resumed run's), written
      again to ``metrics.jsonl`` when it opens; later steps are appended.
    first_step: the step the run starts after.
    compilations: the run's :class:`tracking.Compilations`.
    leader: whether this process writes the files (else nothing is written).
    resume: whether the run is resumed (trackers continue their run).
    progress: show a progress bar.
    log: where text lines go.
  """

  def __init__(
      self,
      config: TrainConfig,
      out: pathlib.Path,
      history: list[dict[str, float]],
      first_step: int,
      compilations: tracking.Compilations,
      *,
      leader: bool,
      resume: bool,
      progress: bool,
      log: Log,
  ):
    self.history = history
    self._config = config
    self._compilations = compilations
    self._log = log
    self._reward_warnings = rewards_lib.RewardFailureWarnings(log)
    self._latest: Optional[scoring.RolloutSamples] = None
    self._bar = tqdm.tqdm(
        range(first_step, config.steps),
        desc="RL",
        disable=not progress,
        dynamic_ncols=True,
        initial=first_step,
        total=config.steps,
    )
    self._trackers = tracking.Trackers(
        config.logging.trackers if leader else [],
        out,
        to_dict(config),
        resume=resume,
    )
    self._samples = tracking.SampleLog(
        out / "samples.jsonl" if leader else pathlib.Path(os.devnull),
        first_step if resume else None,
    )
    self._metrics_path = out / "metrics.jsonl" if leader else os.devnull
    self._open = contextlib.ExitStack()
    self._metrics_file: Any = None

  def __enter__(self) -> "RunLog":
    self._open.enter_context(self._trackers)
    self._open.enter_context(self._samples)
    self._metrics_file = self._open.enter_context(open(self._metrics_path, "w"))
    for metrics in self.history:  # the steps before the checkpoint
      self._metrics_file.write(json.dumps(metrics) + "\n")
    return self

  def __exit__(self, *exc_info) -> None:
    self._open.close()

  def steps(self) -> Iterator[int]:
    """The run's steps still to take (0-based), with the progress bar."""
    return iter(self._bar)

  def observe(self, samples: scoring.RolloutSamples) -> None:
    """Warns of failing reward functions; keeps ``samples`` for the sample
    table."""
    self._reward_warnings(samples.report)
    self._latest = samples

  def step_metrics(
      self,
      rollout_metrics: dict[str, float],
      update: Update,
      step: int,
      sync_metrics: dict[str, float],
  ) -> dict[str, float]:
    """The metrics of ``step`` (1-based): the rollout's, the last
    update's (the realized KL only where measured), compilations, skips
    and sync figures."""
    metrics = dict(rollout_metrics)
    metrics.update(
        {
            k: float(v)
            for k, v in update.metrics.items()
            if not (k.startswith(REALIZED) and np.isnan(v))
        }
    )
    metrics.update(self._compilations.metrics())
    metrics["step"] = step
    metrics["skipped"] = float(bool(update.skipped))
    metrics["skipped/total"] = float(update.guard.skipped_steps)
    metrics.update(sync_metrics)
    return metrics

  def record(self, metrics: dict[str, float], step: int) -> None:
    """Appends ``metrics`` to the history, ``metrics.jsonl`` and the
    trackers; writes and shows a sample table when one is due."""
    self.history.append(metrics)
    self._metrics_file.write(json.dumps(metrics) + "\n")
    self._metrics_file.flush()
    self._trackers.log(metrics, step)
    if tracking.samples_due(step, self._config.logging.samples_every):
      rows = tracking.sample_rows(
          self._latest,
          self._config.rollout.num_generations,
          self._config.logging.samples_shown,
      )
      self._samples.write(step, rows)
      self._log(tracking.sample_table(rows, step))

  def show(self, metrics: dict[str, float]) -> None:
    """Shows a step's reward, accuracy and KL on the progress bar."""
    postfix = {
        "reward": f"{metrics['reward/total']:.3f}",
        "acc": f"{metrics['accuracy/train']:.2f}",
    }
    if REALIZED in metrics:
      postfix["kl"] = f"{metrics[REALIZED]:.1e}"
    if "kl/predicted" in metrics:
      postfix["kl_pred"] = f"{metrics['kl/predicted']:.1e}"
    self._bar.set_postfix(postfix)
