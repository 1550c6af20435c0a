"""Time to the first RL step of `logra train --preset smoke`: a first run on
a machine (no warm-started policy, no compiled program cached) against the
second and third runs (the warm start and XLA's compiled programs read back
from `~/.cache/logra_jax`).

Each trial starts from an empty home folder (so empty caches), then runs
`logra train --preset smoke --no-progress` three times in it and records,
per run, the seconds from the process start to the line announcing step
1's samples (the end of the first RL step), the compile seconds of that
step (`compile/seconds` in `metrics.jsonl`) and the machine's load average.
Reports each trial's ratio of the second run's time to the first's, and
the median over trials.

The environment matters: `tensorboardX` (the default tracker) imports
PyTorch when it is installed (about 1.4 s here), which the main job's
install (`pip install -e .`) does not bring; run this script with the
Python of such an install.

Writes ``first_step.md`` and ``first_step.json`` to
``experiments/results/first_step/`` (``--results``).

Run: python experiments/first_step.py [--trials 3] [--logra logra]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import provenance
import study

RESULTS = study.RESULTS / "first_step"
MARK = "samples at step 1"  # printed when step 1 has finished


def one_run(logra: str, environ: dict[str, str], out: pathlib.Path) -> dict:
  """One `logra train --preset smoke`: seconds to the end of step 1."""
  start = time.perf_counter()
  process = subprocess.Popen(
      [logra, "train", "--preset", "smoke", "--no-progress", "--out", str(out)],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=environ,
  )
  first = None
  for line in process.stdout:
    if first is None and MARK in line:
      first = time.perf_counter() - start
  if process.wait() != 0 or first is None:
    raise SystemExit(f"{logra} train --preset smoke failed in {out}")
  metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
  return {
      "first_step_s": round(first, 2),
      "compile_s": round(metrics["compile/seconds"], 2),
      "load_average": round(os.getloadavg()[0], 2),
  }


def trial(logra: str) -> list[dict]:
  """Three runs in a fresh home folder (empty caches)."""
  with tempfile.TemporaryDirectory() as home:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION", "LOGRA_", "XDG_CACHE"))
    }
    environ["HOME"] = home
    return [
        one_run(logra, environ, pathlib.Path(home) / f"run{i}")
        for i in range(3)
    ]


def table(trials: list[list[dict]], record: str) -> str:
  """The markdown: per trial the three runs, and the ratios."""
  lines = [
      "Seconds from `logra train --preset smoke` starting to the end of its "
      "first RL step; each trial from empty caches (a fresh home folder). "
      "Load average: the machine's other work while it ran.",
      "",
      "| trial | first run s (compile s) | second run s (compile s) "
      "| third run s (compile s) | second / first | load average |",
      "|---:|---:|---:|---:|---:|---:|",
  ]
  for i, runs in enumerate(trials):
    cells = " | ".join(
        f"{r['first_step_s']:.1f} ({r['compile_s']:.1f})" for r in runs
    )
    lines.append(
        f"| {i + 1} | {cells} "
        f"| {runs[1]['first_step_s'] / runs[0]['first_step_s']:.2f} "
        f"| {statistics.fmean(r['load_average'] for r in runs):.1f} |"
    )
  ratio = statistics.median(
      t[1]["first_step_s"] / t[0]["first_step_s"] for t in trials
  )
  lines += ["", f"Median second / first: {ratio:.2f}.", "", record]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=3)
  parser.add_argument("--logra", default="logra", help="the logra command")
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
  args = parser.parse_args()
  if args.trials < 1:
    parser.exit(2, f"{parser.prog}: error: --trials must be >= 1\n")
  trials = [trial(args.logra) for _ in range(args.trials)]
  args.results.mkdir(parents=True, exist_ok=True)
  text = table(trials, study.footer(provenance.this_command()))
  (args.results / "first_step.md").write_text(text)
  (args.results / "first_step.json").write_text(
      json.dumps({"trials": trials}, indent=1) + "\n"
  )
  print(text)


if __name__ == "__main__":
  main()
