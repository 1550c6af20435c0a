"""What the studies in `experiments/` share: arms x tasks x seeds of
`logra train` (finished runs reused only when their config and the code's
numerics fingerprint match), bad input refused before anything runs, and
reports (CSV, markdown, PNG) that record their provenance under
`experiments/results/<study>/`.

A study is a table of named arms (config overrides) run on named tasks
(config overrides) over seeds. `--quick` shrinks every run to the smoke
preset for a few steps, so that the test suite can check a study's outputs
are well-formed; its results go to a folder of their own and never replace
a full run's. A results folder remembers the command-line settings that made
it (`study.json`): a run with other settings is refused there (exit 2)
unless `--overwrite` says so. A study that then fails on bad input gives the
folder back as it found it. A study holds the lock of its runs' folder
(`--out`) from then on: a second study on the same `--out` is refused, and a
run folder that a live run holds is never touched.

Reuse: a run folder holds `fingerprint.json`, the numerics fingerprint
(:mod:`provenance`) of the code that started it. A finished (or
interrupted) run is reused only when its config and that fingerprint both
match this invocation's; otherwise it is run again from the start.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import signal
import sys
from typing import Any, Callable, Sequence

import filelock
import jax
import numpy as np

import provenance
import stats
from logra_jax import cli
from logra_jax import configs
from logra_jax.checkpoint import folders
from logra_jax.rl import compilation_cache
from logra_jax.rl import scoring
from logra_jax.rl import setup
from logra_jax.rl import trainer

RESULTS = pathlib.Path(__file__).parent / "results"

# The tiny preset with fewer prompts per step, so that one run takes about a
# minute on 2 cores (the default's 64 prompts x 260 steps take 2.5).
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


def parser(
    description: str,
    study: str,
    seeds_help: str = "seeds per arm and task (3; 1 with --quick)",
    runs: bool = True,
) -> argparse.ArgumentParser:
  """The flags every study takes; ``--seeds`` and ``--rerun`` only where it
  trains runs of its own (``runs``)."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument(
      "--quick",
      action="store_true",
      help="a few smoke-preset steps per run (checks the outputs only)",
  )
  if runs:
    p.add_argument("--seeds", type=int, help=seeds_help)
    p.add_argument(
        "--rerun", action="store_true", help="redo runs already finished"
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
      "--overwrite",
      action="store_true",
      help="replace a results folder made with other settings",
  )
  p.add_argument(
      "--fingerprint-cache",
      default="runs/fingerprints",
      help="where the code's numerics fingerprints are cached",
  )
  return p


class _Claims:
  """What this process claimed: the lock of its runs' folder (held until the
  process exits) and how to give its results folder back."""

  def __init__(self):
    self.locks = []
    self.undo: list[Callable[[], None]] = []

  def give_back(self) -> None:
    """Leaves the folders as this study found them; releases the locks."""
    while self.undo:
      self.undo.pop()()
    while self.locks:
      self.locks.pop().release()


_CLAIMS = _Claims()


def fail(message: str) -> None:
  """Bad input: one line on stderr, exit status 2 (as argparse's); a
  results folder claimed by :func:`results_folder` is given back."""
  _CLAIMS.give_back()
  print(f"{pathlib.Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
  raise SystemExit(2)


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
  """The parsed flags, ``--seeds`` (where taken) defaulted and checked."""
  args = parser.parse_args()
  if "seeds" not in args:
    return args
  if args.seeds is None:
    args.seeds = 1 if args.quick else 3
  if args.seeds < 1:
    fail(f"--seeds must be >= 1, got {args.seeds}")
  return args


def check_positive(flag: str, value: float | None) -> None:
  """Exits (status 2, one line) unless ``value`` (``--flag``'s; None: not
  given) is a finite number > 0."""
  if value is not None and not (math.isfinite(value) and value > 0):
    fail(f"--{flag} must be a finite number > 0, got {value}")


def check_names(
    parser: argparse.ArgumentParser, kind: str, names: Sequence[str], valid
) -> None:
  """Exits (status 2, one line) naming the unknown names and the valid
  ones."""
  unknown = [n for n in names if n not in valid]
  if unknown:
    parser.exit(
        2,
        f"{parser.prog}: error: unknown {kind} {unknown}; valid: "
        f"{sorted(valid)}\n",
    )
  if len(set(names)) != len(names):
    parser.exit(2, f"{parser.prog}: error: {kind} named twice: {list(names)}\n")


def run_config(args: argparse.Namespace, overrides: list[str], preset=None):
  """The config of one run: ``preset`` (smoke with ``--quick``, else tiny)
  with ``overrides``, then ``--set``; a bad override exits (status 2)."""
  preset = preset or ("smoke" if args.quick else "tiny")
  try:
    return configs.apply_overrides(
        configs.get_preset(preset), overrides + args.set
    )
  except ValueError as error:
    fail(" ".join(str(error).split()))


def sampler(config) -> tuple[Any, Callable]:
  """The starting policy of ``config``'s run, loaded as the run loads it,
  and ``sample(params, step)``: the step's rollout batch and metrics, its
  training prompts drawn from ``config.seed``'s stream (one call per step,
  in order), sampled with ``params`` (the policy's, or a view of them)."""
  task = setup.load_task(config)
  train_split, _ = task.split(config.task.eval_size, seed=config.task.seed)
  rewards = setup.run_rewards(config, task)
  policy = setup.load_policy(
      config, setup.policy_folder(config, train_split), None, print
  )
  rng = np.random.default_rng(config.seed)
  size = config.rollout.prompts_per_step

  def sample(params, step: int):
    picked = rng.integers(len(train_split), size=size)
    examples = [train_split[i] for i in picked]
    return scoring.rollout(
        policy, params, examples, config, rewards, jax.random.key(step)
    )

  return policy, sample


def task_overrides(args: argparse.Namespace, task: str, seed: int) -> list:
  """The overrides of a run of :data:`TASKS`' ``task`` (before an arm's)."""
  return FULL + TASKS[task] + (QUICK if args.quick else []) + [f"seed={seed}"]


def results_path(args: argparse.Namespace, study: str) -> pathlib.Path:
  """Where a study's results go: ``--results``, else
  ``experiments/results/<study>`` (``<study>-quick`` with ``--quick``)."""
  default = RESULTS / (f"{study}-quick" if args.quick else study)
  return pathlib.Path(args.results) if args.results else default


def results_folder(args: argparse.Namespace, study: str) -> pathlib.Path:
  """The results folder, claimed for the run's settings (every flag but
  those of :data:`_NOT_SETTINGS`; written to its ``study.json``). A folder
  holding results of other settings is refused (exit 2, naming both)
  unless ``--overwrite``. Call it after every check
  of the input, so that bad input leaves nothing behind; bad input found
  later (:func:`fail`) gives the folder back. Takes the lock of the runs'
  folder ``--out`` too (:func:`lock_runs`)."""
  settings = {
      k: v for k, v in sorted(vars(args).items()) if k not in _NOT_SETTINGS
  }
  folder = results_path(args, study)
  record = folder / "study.json"
  if record.exists() and not args.overwrite:
    earlier = json.loads(record.read_text())
    if earlier != settings:
      changed = sorted(
          k
          for k in set(earlier) | set(settings)
          if earlier.get(k) != settings.get(k)
      )
      fail(
          f"{folder} holds the results of other settings ({', '.join(changed)}"
          f" differ: there {[earlier.get(k) for k in changed]}, now "
          f"{[settings.get(k) for k in changed]}); pass --overwrite to "
          "replace them or --results for another folder"
      )
  lock_runs(args)
  compilation_cache.enable_compilation_cache()
  _CLAIMS.undo.append(_restorer(folder, record))
  folder.mkdir(parents=True, exist_ok=True)
  record.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
  return folder


def _restorer(folder: pathlib.Path, record: pathlib.Path) -> Callable:
  """A function that puts back ``folder`` and its ``record`` as they are
  now (the record's text, or no record and no folder if empty)."""
  existed = folder.exists()
  text = record.read_text() if record.exists() else None

  def restore() -> None:
    if text is not None:
      record.write_text(text)
      return
    record.unlink(missing_ok=True)
    if not existed and folder.is_dir() and not any(folder.iterdir()):
      folder.rmdir()

  return restore


def lock_runs(args: argparse.Namespace) -> None:
  """Holds the lock of the runs' folder ``--out`` until the process exits
  (:func:`logra_jax.checkpoint.folders.run_lock`); exits (status 2) if
  another study holds it."""
  out = pathlib.Path(args.out)
  undo = _restorer(out, out / ".lock")
  out.mkdir(parents=True, exist_ok=True)
  lock = folders.run_lock(out)
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    fail(
        f"--out {out} is in use by another study (it holds {out / '.lock'});"
        " wait for it to end or choose another --out"
    )
  _CLAIMS.locks.append(lock)
  _CLAIMS.undo.append(undo)


def fingerprint(args: argparse.Namespace) -> str:
  """This code's numerics fingerprint (computed once per invocation)."""
  return provenance.fingerprint(args.fingerprint_cache)


def needs_rerun(folder: pathlib.Path, fingerprint_value: str) -> bool:
  """Whether a run folder's contents were made by code of another numerics
  fingerprint (or of an unknown one): then it is run again from scratch.

  Example:
    >>> needs_rerun(pathlib.Path("/nonexistent"), "ab12")
    True
  """
  record = folder / "fingerprint.json"
  if not record.exists():
    return True
  return json.loads(record.read_text()).get("fingerprint") != fingerprint_value


def train(
    args: argparse.Namespace, config, folder: pathlib.Path
) -> dict[str, Any]:
  """``config`` trained in ``folder``, reused when it finished there with
  the same config and fingerprint; its summary and per-step metrics
  (``"history"``). A folder a live run holds is left as it is (exit
  status 2), and so is bad input the trainer finds (one line, exit 2)."""
  if folders.in_use(folder):
    fail(
        f"{folder} is in use by a run (it holds {folder / '.lock'}); wait "
        "for it to end"
    )
  value = fingerprint(args)
  rerun = args.rerun or needs_rerun(folder, value)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "fingerprint.json").write_text(
      json.dumps({"fingerprint": value}) + "\n"
  )
  try:
    summary = trainer.train_or_reuse(config, folder, rerun)
  except cli.BAD_INPUT as error:  # as logra train's exit status 2
    fail(" ".join(str(error).split()))
  if summary.get("stopped_by"):  # the study stops too; its next run resumes
    print(
        f"stopped by {summary['stopped_by']} after step {summary['steps']} "
        f"of {folder}; run the same command again to resume",
        file=sys.stderr,
    )
    raise SystemExit(128 + signal.Signals[summary["stopped_by"]].value)
  history = [
      json.loads(line)
      for line in (folder / "metrics.jsonl").read_text().splitlines()
  ]
  return {"summary": summary, "history": history}


def run(
    args: argparse.Namespace,
    arm: str,
    arm_overrides: list[str],
    task: str,
    seed: int,
) -> dict[str, Any]:
  """One run of a study on :data:`TASKS` (reused when finished): its
  summary and its per-step metrics (``"history"``)."""
  config = run_config(args, task_overrides(args, task, seed) + arm_overrides)
  out = pathlib.Path(args.out) / ("quick" if args.quick else "full")
  result = train(args, config, out / task / f"{arm}-seed{seed}")
  summary = result["summary"]
  print(
      f"{task} {arm} seed {seed}: held-out accuracy "
      f"{summary['eval_accuracy_before']:.3f} -> "
      f"{summary['eval_accuracy_after']:.3f}",
      flush=True,
  )
  return result


# Flags that say where things go or whether to redo them, not what is run.
_NOT_SETTINGS = (
    "out",
    "results",
    "rerun",
    "overwrite",
    "fingerprint_cache",
    "report_only",
)


def footer(command: str) -> str:
  """The line under a benchmark's table: command, commit, date, machine,
  versions (no numerics fingerprint: benchmarks measure time, not
  numbers)."""
  return provenance.footer(provenance.collect(command, "not computed"))


def provenance_record(args: argparse.Namespace) -> dict[str, Any]:
  """This invocation's provenance (:func:`provenance.collect`); a full
  (not ``--quick``) study whose reports go under :data:`RESULTS` notes its
  fingerprint in the ledger (:func:`provenance.note_fingerprint`) that
  those results are read with."""
  value = fingerprint(args)
  if not args.quick and writes_results(args):
    provenance.note_fingerprint(value)
  return provenance.collect(provenance.this_command(), value)


def writes_results(args: argparse.Namespace) -> bool:
  """Whether the reports go under :data:`RESULTS`: ``--results`` not given
  (each study's default folder is there) or a folder inside it.

  Example:
    >>> writes_results(argparse.Namespace(results="/tmp/elsewhere"))
    False
  """
  if args.results is None:
    return True
  return pathlib.Path(args.results).resolve().is_relative_to(RESULTS.resolve())


def write_provenance(record: dict[str, Any], folder: pathlib.Path) -> None:
  """``provenance.json`` beside a study's reports."""
  (folder / "provenance.json").write_text(
      json.dumps(record, indent=1, sort_keys=True) + "\n"
  )


def mean_ci(values: Sequence[float]) -> str:
  """``mean [95% CI]`` over seeds (:func:`stats.mean_ci`)."""
  return str(stats.mean_ci(values))


def write_csv(
    rows: list[dict[str, Any]], path: pathlib.Path, record: dict[str, Any]
) -> None:
  """The rows, each with the commit and fingerprint of ``record`` unless
  it has its own."""
  stamped = [
      {"commit": record["commit"], "fingerprint": record["fingerprint"], **r}
      for r in rows
  ]
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(stamped[0]))
    writer.writeheader()
    writer.writerows(stamped)


def _band(values):
  """Mean over seeds (rows) of each column's finite values and its 95%
  Student-t half width (0 where a column has one finite value)."""
  means, halves = [], []
  for column in values.T:
    finite = column[np.isfinite(column)]
    means.append(finite.mean() if len(finite) else np.nan)
    halves.append(
        stats.t_half_width(finite.std(ddof=1), len(finite))
        if len(finite) > 1
        else 0.0
    )
  return np.array(means), np.array(halves)


def arm_styles(arms: Sequence[str]) -> dict[str, tuple[Any, str]]:
  """A (colour, line style) per arm: an arm and its KL-controlled twin
  (``arm+kl``) share a colour, the twin dashed; past ten base arms the
  colours repeat with dash-dotted and dotted lines instead.

  Example:
    >>> s = arm_styles(["adam", "logra", "adam+kl"])
    >>> s["adam"][0] == s["adam+kl"][0], s["adam"][1], s["adam+kl"][1]
    (True, '-', '--')
  """
  import matplotlib  # noqa: PLC0415

  palette = matplotlib.colormaps["tab10"].colors
  bases = list(dict.fromkeys(a.removesuffix("+kl") for a in arms))
  styles = {}
  for arm in dict.fromkeys(arms):
    i = bases.index(arm.removesuffix("+kl"))
    lines = ("--", ":") if arm.endswith("+kl") else ("-", "-.")
    styles[arm] = (palette[i % 10], lines[min(i // 10, 1)])
  return styles


def plot_bands(
    panels: list[tuple[str, dict[str, list[list[tuple[float, float]]]]]],
    ylabel: str,
    path: pathlib.Path,
    record: dict[str, Any],
    geometric: bool = False,
    decorate: Callable | None = None,
    columns: int | None = None,
) -> None:
  """One panel per ``(title, {arm: [[(step, value), ...] per seed]})``:
  the mean over seeds with its 95% confidence band (Student t), a legend
  on every panel, each arm in the same colour and line style in every
  panel (:func:`arm_styles`), on a ``yscale`` axis;
  ``decorate(ax)`` adds reference lines. With ``geometric``, the mean and
  band are those of the values' logarithms (the geometric mean; values <= 0
  left out), drawn on a log axis. ``columns`` panels a row (all in one row
  by default). The PNG carries the provenance ``record``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  columns = columns or len(panels)
  rows = -(-len(panels) // columns)
  fig, axes = plt.subplots(
      rows, columns, figsize=(5 * columns, 3.8 * rows), squeeze=False
  )
  for ax in axes.flat[len(panels) :]:
    ax.set_visible(False)
  style = arm_styles([a for _, arms in panels for a in arms])
  for ax, (title, arms) in zip(axes.flat, panels):
    for arm, series in arms.items():
      length = min(len(s) for s in series)
      steps = [x for x, _ in series[0][:length]]
      values = np.array([[y for _, y in s[:length]] for s in series], float)
      if geometric:
        values = np.log(np.where(values > 0, values, np.nan))
      mean, half = _band(values)
      low, high = mean - half, mean + half
      if geometric:
        mean, low, high = np.exp(mean), np.exp(low), np.exp(high)
      colour, dashes = style[arm]
      label = f"{arm} (n={len(series)})"
      ax.plot(steps, mean, color=colour, linestyle=dashes, label=label)
      ax.fill_between(steps, low, high, color=colour, alpha=0.2)
    if decorate is not None:
      decorate(ax)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log" if geometric else "linear")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110, metadata=provenance.png_metadata(record))
  plt.close(fig)
