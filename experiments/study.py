"""What the studies in `experiments/` share: arms x tasks x seeds of
`logra train` (finished runs reused), and their reports (CSV, markdown, PNG)
under `experiments/results/<study>/`.

A study is a table of named arms (config overrides) run on named tasks
(config overrides) over seeds. `--quick` shrinks every run to the smoke
preset for a few steps, so that the test suite can check a study's outputs
are well-formed; its results go to a folder of their own and never replace
a full run's. A results folder remembers the command-line settings that made
it (`study.json`): a run with other settings is refused there unless
`--overwrite` says so.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import platform
import statistics
import time
from typing import Any, Callable, Sequence

from logra_jax import configs
from logra_jax.rl import trainer

RESULTS = pathlib.Path(__file__).parent / "results"

# The tiny preset with fewer prompts per step, so that one run takes about a
# minute on 2 cores (the default's 64 prompts x 260 steps take 7).
FULL = [
    "steps=120",
    "rollout.prompts_per_step=32",
    "eval_every=0",
    "logging.trackers=[]",
    "logging.samples_every=0",
]
QUICK = ["steps=3", "task.eval_size=8", "task.size=400"]

# Reasoning-gym tasks the tiny decoder learns on CPU (prompts in the task's
# own short form; answers scored by the generator's `score_answer`).
TASKS: dict[str, list[str]] = {
    "tiny": [],
    "products": [
        "task.name=products",
        "task.options={min_terms: 2, max_terms: 2, min_digits: 1, "
        "max_digits: 1}",
        "task.template={expression}=",
        "task.size=5000",
        # 100 distinct products: 20 held out.
        "task.eval_size=20",
    ],
    "count_bits": [
        "task.name=count_bits",
        "task.options={min_n: 1, max_n: 255}",
        "task.template=bits({number})=",
        "task.size=5000",
        # 255 distinct numbers: 50 held out.
        "task.eval_size=50",
    ],
}


def parser(description: str, study: str) -> argparse.ArgumentParser:
  """The flags every study takes."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument(
      "--quick",
      action="store_true",
      help="a few smoke-preset steps per run (checks the outputs only)",
  )
  p.add_argument(
      "--seeds", type=int, help="seeds per arm and task (3; 1 with --quick)"
  )
  p.add_argument("--out", default=f"runs/{study}", help="the runs' folders")
  p.add_argument(
      "--results",
      help=f"where the reports go (default experiments/results/{study}, "
      f"or experiments/results/{study}-quick with --quick)",
  )
  p.add_argument(
      "--set",
      action="append",
      default=[],
      help="a config override for every run (key=value)",
  )
  p.add_argument(
      "--rerun", action="store_true", help="redo runs already finished"
  )
  p.add_argument(
      "--overwrite",
      action="store_true",
      help="replace a results folder made with other settings",
  )
  return p


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
  """The parsed flags, ``--seeds`` defaulted and checked."""
  args = parser.parse_args()
  if args.seeds is None:
    args.seeds = 1 if args.quick else 3
  if args.seeds < 1:
    parser.error(f"--seeds must be >= 1, got {args.seeds}")
  return args


def check_names(
    parser: argparse.ArgumentParser, kind: str, names: Sequence[str], valid
) -> None:
  """Exits with an error naming the unknown names and the valid ones."""
  unknown = [n for n in names if n not in valid]
  if unknown:
    parser.error(f"unknown {kind} {unknown}; valid: {sorted(valid)}")
  if len(set(names)) != len(names):
    parser.error(f"{kind} named twice: {list(names)}")


def results_folder(args: argparse.Namespace, study: str) -> pathlib.Path:
  """The results folder, claimed for the run's settings (arms, tasks,
  seeds, overrides, quick and the study's own options; written to its
  ``study.json``). A folder holding results of other settings is refused
  (SystemExit naming both) unless ``--overwrite``."""
  settings = {
      "arms": args.arms,
      "tasks": args.tasks,
      "seeds": args.seeds,
      "set": args.set,
      "quick": args.quick,
      **_own_options(args),
  }
  default = RESULTS / (f"{study}-quick" if args.quick else study)
  folder = pathlib.Path(args.results) if args.results else default
  record = folder / "study.json"
  if record.exists() and not args.overwrite:
    earlier = json.loads(record.read_text())
    if earlier != settings:
      changed = sorted(
          k
          for k in set(earlier) | set(settings)
          if earlier.get(k) != settings.get(k)
      )
      raise SystemExit(
          f"{folder} holds the results of other settings ({', '.join(changed)}"
          f" differ: there {[earlier.get(k) for k in changed]}, now "
          f"{[settings.get(k) for k in changed]}); pass --overwrite to "
          "replace them or --results for another folder"
      )
  folder.mkdir(parents=True, exist_ok=True)
  record.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
  return folder


def run(
    args: argparse.Namespace,
    arm: str,
    arm_overrides: list[str],
    task: str,
    seed: int,
) -> dict[str, Any]:
  """One run of the study (reused when finished): its summary and its
  per-step metrics (``"history"``)."""
  preset = "smoke" if args.quick else "tiny"
  overrides = (
      FULL
      + TASKS[task]
      + (QUICK if args.quick else [])
      + arm_overrides
      + args.set
      + [f"seed={seed}"]
  )
  config = configs.apply_overrides(configs.get_preset(preset), overrides)
  out = pathlib.Path(args.out) / ("quick" if args.quick else "full")
  folder = out / task / f"{arm}-seed{seed}"
  summary = trainer.train_or_reuse(config, folder, args.rerun)
  history = [
      json.loads(line)
      for line in (folder / "metrics.jsonl").read_text().splitlines()
  ]
  print(
      f"{task} {arm} seed {seed}: held-out accuracy "
      f"{summary['eval_accuracy_before']:.3f} -> "
      f"{summary['eval_accuracy_after']:.3f}",
      flush=True,
  )
  return {"summary": summary, "history": history, "overrides": overrides}


# Flags that say where things go or whether to redo them, not what is run.
_NOT_SETTINGS = ("out", "results", "rerun", "overwrite")
_COMMON = ("quick", "seeds", "arms", "tasks", "set")


def _own_options(args: argparse.Namespace) -> dict[str, Any]:
  """A study's own options (e.g. kl_control's ``--target-kl``)."""
  return {
      k: v
      for k, v in sorted(vars(args).items())
      if k not in _NOT_SETTINGS + _COMMON
  }


def command(study: str, args: argparse.Namespace) -> str:
  """The command line that reproduces a study's results."""
  return " ".join(
      [f"python experiments/{study}.py"]
      + (["--quick"] if args.quick else [])
      + [f"--seeds {args.seeds}", "--arms", *args.arms, "--tasks", *args.tasks]
      + [f"--set {s}" for s in args.set]
      + [
          f"--{name.replace('_', '-')} {value}"
          for name, value in _own_options(args).items()
      ]
  )


def mean_std(values: Sequence[float]) -> str:
  """``mean ± std`` (std over seeds; 0 for one)."""
  std = statistics.stdev(values) if len(values) > 1 else 0.0
  return f"{statistics.mean(values):.3f} ± {std:.3f}"


def write_csv(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def footer(command: str) -> str:
  """The line under every table: command, date, machine."""
  import jax

  device = jax.devices()[0]
  machine = (
      f"{platform.machine()} CPU"
      if device.platform == "cpu"
      else f"{jax.device_count()} x {device.device_kind}"
  )
  return f"Command: `{command}`; {time.strftime('%Y-%m-%d')}, {machine}."


def plot_bands(
    panels: list[tuple[str, dict[str, list[list[dict]]]]],
    metric: Callable[[dict], float],
    ylabel: str,
    path: pathlib.Path,
    yscale: str = "linear",
) -> None:
  """One panel per ``(title, {arm: [history per seed]})``: ``metric`` of each
  step, mean over seeds with a band of one standard deviation, on a
  ``yscale`` axis."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  fig, axes = plt.subplots(
      1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False
  )
  for ax, (title, arms) in zip(axes[0], panels):
    for arm, histories in arms.items():
      length = min(len(h) for h in histories)
      values = np.array(
          [[metric(row) for row in h[:length]] for h in histories], float
      )
      steps = [row["step"] for row in histories[0][:length]]
      mean, std = values.mean(axis=0), values.std(axis=0)
      (line,) = ax.plot(steps, mean, label=arm)
      ax.fill_between(
          steps, mean - std, mean + std, color=line.get_color(), alpha=0.2
      )
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_yscale(yscale)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
