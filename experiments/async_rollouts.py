"""Asynchronous rollouts against the synchronous loop, the engine in its own
process: step time and held-out accuracy over seeds.

Each seed runs the same config twice with ``rollout.engine=process``: with
``rollout.max_staleness=0`` (the engine samples each batch with the newest
weights, the learner waits) and ``=1`` (the engine samples batch k+1 with
policy version k-1 while the learner trains on batch k). Reports the median
step time (steps after the first two, which compile), the held-out accuracy
after training (mean and spread over seeds), the version lags seen, and
whether the asynchronous accuracies fall within the synchronous seeds'
range and mean; writes ``async_rollouts.csv`` and ``async_rollouts.md`` to
``--results``.

``--gpu`` runs the accelerator study instead: the engine colocated with the
learner on one device, a decoder of Qwen2.5-0.5B's body shape (896 wide, 24
layers, 14 query and 2 key/value heads, MLP 4864; the task's own small
vocabulary), 20 steps of 64 prompts x 8 completions, one seed.

Run: python experiments/async_rollouts.py [--quick] [--gpu] [--seeds 3]
     [--out runs/async_rollouts] [--set key=value ...]
     [--from-csv FILE]  (the report of an earlier run's CSV)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import platform
import statistics
import time

import jax

from logra_jax import configs
from logra_jax.rl import trainer

# A study small enough for a 2-core CPU: the tiny preset's task and policy,
# fewer prompts per step.
STUDY = [
    "steps=60",
    "eval_every=0",
    "rollout.prompts_per_step=16",
    "rollout.num_generations=8",
    "task.eval_size=64",
    "rollout.engine=process",
    "logging.trackers=[]",
    "logging.samples_every=0",
]
QUICK = ["steps=3", "task.eval_size=8"]
# The accelerator study: what the asynchronous loop overlaps when the engine
# shares the learner's device (host work: decoding, scoring, batching).
GPU = [
    "rollout.engine=colocated",
    "policy.hidden_size=896",
    "policy.num_layers=24",
    "policy.num_heads=14",
    "policy.num_kv_heads=2",
    "policy.intermediate_size=4864",
    "policy.warm_start_steps=60",
    "steps=20",
    "rollout.prompts_per_step=64",
    "task.eval_size=128",
]


def run_arm(
    preset: str, overrides: list[str], out: pathlib.Path
) -> dict[str, float]:
  config = configs.load_config(preset, [], overrides)
  summary = trainer.train(config, out, progress=False, log=lambda text: None)
  metrics = [
      json.loads(line)
      for line in (out / "metrics.jsonl").read_text().splitlines()
  ]
  steady = [m["time/step_s"] for m in metrics[2:]] or [
      m["time/step_s"] for m in metrics
  ]
  return {
      "accuracy_before": summary["eval_accuracy_before"],
      "accuracy_after": summary["eval_accuracy_after"],
      "step_s_median": statistics.median(steady),
      "max_version_lag": max(m["rollout/version_lag"] for m in metrics),
      "wall_s": summary["wall_seconds"],
  }


def spread(values: list[float]) -> str:
  if len(values) < 2:
    return f"{values[0]:.3f}"
  return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument(
      "--gpu",
      action="store_true",
      help="the accelerator study (colocated engine, 0.5B body shape)",
  )
  parser.add_argument(
      "--seeds",
      type=int,
      help="seeds per arm (default 3; 1 with --gpu or --quick)",
  )
  parser.add_argument("--out", default="runs/async_rollouts")
  parser.add_argument(
      "--results",
      default=str(pathlib.Path(__file__).parent / "results" / "async_rollouts"),
  )
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument(
      "--from-csv",
      help="write the report of an earlier run's async_rollouts.csv "
      "(with that run's --seeds/--set, for its command line) instead of "
      "running",
  )
  args = parser.parse_args()
  if args.seeds is None:
    args.seeds = 1 if args.gpu or args.quick else 3
  gpu = GPU if args.gpu else []
  preset, overrides = "tiny", STUDY + gpu + args.set
  if args.quick:  # with --gpu: its code path on the smoke policy's shape
    gpu = [o for o in gpu if not o.startswith("policy.")]
    preset, overrides = "smoke", STUDY + gpu + QUICK + args.set
  if args.seeds < 1:
    parser.error("--seeds must be >= 1")
  out, results = pathlib.Path(args.out), pathlib.Path(args.results)
  results.mkdir(parents=True, exist_ok=True)
  if args.from_csv:
    with open(args.from_csv, newline="") as f:
      rows = list(csv.DictReader(f))
    write_report(rows, results, _command(args), overrides)
    return
  rows = []
  for seed in range(args.seeds):
    for staleness in (0, 1):  # alternating, so load drifts hit both arms
      arm = f"max_staleness={staleness}"
      row = run_arm(
          preset,
          overrides + [f"seed={seed}", f"rollout.max_staleness={staleness}"],
          out / f"seed{seed}-staleness{staleness}",
      )
      rows.append({"arm": arm, "seed": seed, **row})
      print(json.dumps(rows[-1]), flush=True)
  with open(results / "async_rollouts.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  write_report(rows, results, _command(args), overrides)


def _command(args: argparse.Namespace) -> str:
  """The command line that reproduces a run (``--from-csv`` aside)."""
  flags = [flag for flag in ("quick", "gpu") if getattr(args, flag)]
  return " ".join(
      ["python experiments/async_rollouts.py"]
      + [f"--{flag}" for flag in flags]
      + [f"--seeds {args.seeds}"]
      + [f"--set {s}" for s in args.set]
  )


def _machine() -> str:
  device = jax.devices()[0]
  if device.platform == "cpu":
    return (
        f"{platform.machine()} {platform.system()} CPU, {os.cpu_count()} cores"
    )
  return f"{jax.device_count()} x {device.device_kind}"


def write_report(
    rows: list[dict], results: pathlib.Path, command: str, overrides: list[str]
) -> None:
  """``async_rollouts.md``: the table of both arms and how the asynchronous
  accuracies compare with the synchronous seeds'."""
  arms = {r["arm"]: [x for x in rows if x["arm"] == r["arm"]] for r in rows}
  sync_acc = [float(r["accuracy_after"]) for r in arms["max_staleness=0"]]
  async_acc = [float(r["accuracy_after"]) for r in arms["max_staleness=1"]]
  sync_step = statistics.median(
      float(r["step_s_median"]) for r in arms["max_staleness=0"]
  )
  lines = [
      "| arm | held-out accuracy after (mean ± std over seeds) | median "
      "s/step (vs sync) | max version lag |",
      "|---|---|---|---|",
  ]
  for arm, runs in arms.items():
    step = statistics.median(float(r["step_s_median"]) for r in runs)
    lines.append(
        f"| {arm} | {spread([float(r['accuracy_after']) for r in runs])} | "
        f"{step:.3f} ({step / sync_step:.2f}) | "
        f"{max(float(r['max_version_lag']) for r in runs):.0f} |"
    )
  low, high = min(sync_acc), max(sync_acc)
  mean, std = statistics.mean(sync_acc), (
      statistics.stdev(sync_acc) if len(sync_acc) > 1 else 0.0
  )
  inside = sum(low <= a <= high for a in async_acc)
  above = sum(a > high for a in async_acc)
  lines += [
      "",
      f"Asynchronous seeds within the synchronous seeds' range "
      f"[{low:.3f}, {high:.3f}]: {inside} of {len(async_acc)} ({above} above "
      f"it); asynchronous mean {statistics.mean(async_acc):.3f} against the "
      f"synchronous mean ± std {mean:.3f} ± {std:.3f}.",
      "",
      f"Command: `{command}`; {time.strftime('%Y-%m-%d')}, "
      f"{_machine()}; overrides "
      f"{' '.join(overrides)}.",
  ]
  (results / "async_rollouts.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
