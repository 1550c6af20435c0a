"""A run's report: its summary (``summary.json``), the curves
(``curves.png``) and the closing line."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

from matplotlib import figure

Log = Callable[[str], None]

# The realized KL's metrics (kl/realized, kl/realized_k3), recorded on the
# steps that measure it (logging.realized_kl_every).
REALIZED = "kl/realized"


def write_report(
    summary: dict[str, Any],
    history: list[dict[str, float]],
    out: pathlib.Path,
    leader: bool,
    log: Log,
) -> None:
  """Writes ``curves.png`` and ``summary.json`` (on the leader) and logs
  the held-out accuracy before and after, the steps, the wall time and the
  optimizer state's size against dense Adam's."""
  before = summary["eval_accuracy_before"]
  after = summary["eval_accuracy_after"]
  if history and leader:
    final = dict(history[-1], **{"accuracy/eval": after})
    plot_curves(history[:-1] + [final], out / "curves.png", before)
  if leader:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
  log(
      f"held-out accuracy {before:.3f} -> {after:.3f} "
      f"in {len(history)} steps, {summary['wall_seconds']:.0f}s; optimizer "
      f"state {summary['optimizer_state_bytes'] / 2**20:.2f} MiB "
      f"({summary['optimizer']}) vs dense Adam "
      f"{summary['dense_adam_state_bytes'] / 2**20:.2f} MiB"
  )


def plot_curves(
    history: list[dict[str, float]], path: pathlib.Path, accuracy_before: float
) -> None:
  """Reward/accuracy, realized KL and step time against the step."""
  steps = [h["step"] for h in history]
  # A figure of its own, without pyplot: no backend is chosen or changed.
  fig = figure.Figure(figsize=(14, 3.8))
  axes = fig.subplots(1, 3)
  axes[0].plot(steps, [h["reward/total"] for h in history], label="reward")
  axes[0].plot(
      steps,
      [h["accuracy/train"] for h in history],
      label="train accuracy",
      alpha=0.7,
  )
  evals = [(0, accuracy_before)] + [
      (h["step"], h["accuracy/eval"]) for h in history if "accuracy/eval" in h
  ]
  axes[0].plot(*zip(*evals), "o-", label="held-out accuracy")
  axes[0].set_title("reward and accuracy")
  axes[0].legend()
  realized = [
      (h["step"], h["kl/realized_k3"]) for h in history if REALIZED in h
  ]
  if realized:
    axes[1].plot(*zip(*realized), "o-", label="realized (k3)")
  if "kl/predicted" in history[0]:
    axes[1].plot(
        steps,
        [h["kl/predicted"] for h in history],
        label="predicted",
        alpha=0.7,
    )
    axes[1].legend()
  axes[1].set_yscale("log")
  axes[1].set_title("KL per step")
  axes[2].plot(steps, [h["time/step_s"] for h in history])
  axes[2].set_title("step time (s)")
  for ax in axes:
    ax.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
