"""What `policy.batch_invariant` costs per RL step, and how often the
rollout's log-probs then equal the learner's bitwise.

Runs `logra train` on the main job's setting (the ``tiny`` preset, ``--quick``:
the ``smoke`` preset) for ``--steps`` steps with the default numerics, with
the default numerics under the batch-invariant mode's XLA flags (XLA:CPU
without XNNPACK: which share of the cost is the flags'), and with
``policy.batch_invariant=true``, alternating, ``--repeats`` times each, every
run in a fresh process started with no other ``XLA_FLAGS`` (the
batch-invariant run sets its own). From each run's
``metrics.jsonl``, after the first ``--warmup`` steps (compilation): the
median step, rollout and train seconds; and over all steps the fraction
whose ``rollout/logprob_gap_max`` is 0 and the largest gap. The ratio of the
medians (batch-invariant / default) is the overhead.

Writes ``batch_invariance_cost.md`` and ``.json`` to
``experiments/results/batch_invariance_cost/`` (``--results``).

Run: python experiments/batch_invariance_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import provenance
import study
from logra_jax import reduction

# numerics -> (config overrides, XLA_FLAGS the run starts with)
MODES = {
    "default": ([], ""),
    "default, XNNPACK off": ([], " ".join(reduction.CPU_FLAGS)),
    "batch-invariant": (["policy.batch_invariant=true"], ""),
}
TIMES = ("time/step_s", "time/rollout_s", "time/train_s")


def run(
    preset: str,
    steps: int,
    overrides: list[str],
    xla_flags: str,
    out: pathlib.Path,
):
  """One ``logra train`` run in a fresh process; its metrics rows."""
  command = [
      sys.executable,
      "-m",
      "logra_jax.cli",
      "train",
      f"--preset={preset}",
      "--no-progress",
      f"--out={out}",
      f"--set=steps={steps}",
      *(f"--set={o}" for o in overrides),
  ]
  done = subprocess.run(
      command,
      env=dict(os.environ, XLA_FLAGS=xla_flags),
      capture_output=True,
      text=True,
      check=False,
  )
  if done.returncode:
    study.fail(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
  lines = (out / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def summarize(mode: str, repeat: int, metrics: list[dict], warmup: int):
  """One run's row: median times after the warm-up, gaps over all steps."""
  timed = metrics[warmup:] or metrics
  gaps = [m["rollout/logprob_gap_max"] for m in metrics]
  return {
      "mode": mode,
      "repeat": repeat,
      "steps": len(metrics),
      **{key: statistics.median(m[key] for m in timed) for key in TIMES},
      "bitwise_steps": sum(g == 0 for g in gaps) / len(gaps),
      "max_gap": max(gaps),
  }


def table(rows: list[dict], record: dict, preset: str, warmup: int) -> str:
  """The markdown report: per mode, the medians over its runs, the ratio to
  the default, the bitwise fraction and the largest gap."""

  def median(mode, key):
    return statistics.median(r[key] for r in rows if r["mode"] == mode)

  lines = [
      f"`logra train --preset {preset}`, {rows[0]['steps']} steps per run, "
      f"the default numerics (with XLA's default flags, and with the "
      f"batch-invariant mode's) vs `policy.batch_invariant=true`, runs "
      f"alternating; times are the median over steps after the first "
      f"{warmup} (compilation), then over runs; the ratio is the mode's "
      "over the default's. Bitwise steps: the fraction of steps whose "
      "rollout log-probs equal the learner's (`rollout/logprob_gap_max` 0).",
      "",
      "| numerics | runs | step s | rollout s | train s | step ratio "
      "| bitwise steps | max gap |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for mode in MODES:
    runs = [r for r in rows if r["mode"] == mode]
    ratio = median(mode, TIMES[0]) / median("default", TIMES[0])
    lines.append(
        f"| {mode} | {len(runs)} | "
        + " | ".join(f"{median(mode, key):.3f}" for key in TIMES)
        + f" | {ratio:.3f} | {median(mode, 'bitwise_steps'):.3f} "
        f"| {max(r['max_gap'] for r in runs):.3g} |"
    )
  return "\n".join(lines + ["", provenance.footer(record)]) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--quick", action="store_true", help="the smoke preset, 3 steps, 1 run"
  )
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--results")
  parser.add_argument("--fingerprint-cache", default="runs/fingerprints")
  args = parser.parse_args()
  if args.quick:
    args.steps, args.repeats, args.warmup = 3, 1, 1
  if args.repeats < 1 or args.warmup < 0 or args.steps <= args.warmup:
    study.fail(
        "need --repeats >= 1 and --steps > --warmup >= 0, got "
        f"{args.repeats}, {args.steps}, {args.warmup}"
    )
  preset = "smoke" if args.quick else "tiny"
  results = study.results_path(args, "batch_invariance_cost")
  record = study.provenance_record(args)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for repeat in range(args.repeats):
      for i, (mode, (overrides, xla_flags)) in enumerate(MODES.items()):
        out = pathlib.Path(tmp) / f"{i}-{repeat}"
        metrics = run(preset, args.steps, overrides, xla_flags, out)
        rows.append(summarize(mode, repeat, metrics, args.warmup))
  results.mkdir(parents=True, exist_ok=True)
  text = table(rows, record, preset, args.warmup)
  (results / "batch_invariance_cost.md").write_text(text)
  (results / "batch_invariance_cost.json").write_text(
      json.dumps({"rows": rows, "provenance": record}, indent=1) + "\n"
  )
  print(text)


if __name__ == "__main__":
  main()
