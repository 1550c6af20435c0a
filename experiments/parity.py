"""Held-out accuracy and optimizer memory: dense Adam vs GaLore vs LoGRA.

Runs the tiny default task (the same warm-started policy) with each optimizer
and several seeds, then writes `parity.csv` and `parity.md` (accuracy mean and
standard deviation over seeds, optimizer-state bytes) to the output folder.
Finished runs whose `config.yaml` matches are reused (`--rerun` redoes them).

Run: python experiments/parity.py [--seeds 0 1 2] [--out runs/parity]
     [--set key=value ...]   (overrides applied to every run)
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import statistics

from logra_jax.configs import train as train_config
from logra_jax.rl import trainer


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument(
      "--optimizers", nargs="+", default=["adam", "galore", "logra"]
  )
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--out", default="runs/parity")
  parser.add_argument(
      "--rerun", action="store_true", help="redo runs already finished in --out"
  )
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  rows = []
  for name in args.optimizers:
    for seed in args.seeds:
      config = train_config.apply_overrides(
          train_config.get_preset(args.preset),
          args.set + [f"optimizer.name={name}", f"seed={seed}"],
      )
      summary = trainer.train_or_reuse(
          config, out / f"{name}-seed{seed}", args.rerun
      )
      rows.append(
          {
              "optimizer": name,
              "seed": seed,
              **{
                  k: summary[k]
                  for k in (
                      "eval_accuracy_before",
                      "eval_accuracy_after",
                      "optimizer_state_bytes",
                      "dense_adam_state_bytes",
                      "wall_seconds",
                  )
              },
          }
      )
      print(
          f"{name} seed {seed}: {summary['eval_accuracy_before']:.3f} -> "
          f"{summary['eval_accuracy_after']:.3f}",
          flush=True,
      )
  with open(out / "parity.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  lines = [
      "| optimizer | held-out accuracy before | after (mean ± std) "
      "| optimizer state | vs dense Adam |",
      "|---|---:|---:|---:|---:|",
  ]
  for name in args.optimizers:
    runs = [r for r in rows if r["optimizer"] == name]
    after = [r["eval_accuracy_after"] for r in runs]
    std = statistics.stdev(after) if len(after) > 1 else 0.0
    state = runs[0]["optimizer_state_bytes"]
    lines.append(
        f"| {name} | {statistics.mean(r['eval_accuracy_before'] for r in runs):.3f}"
        f" | {statistics.mean(after):.3f} ± {std:.3f} | "
        f"{state / 2**20:.2f} MiB | "
        f"{state / runs[0]['dense_adam_state_bytes']:.3f} |"
    )
  table = "\n".join(lines)
  (out / "parity.md").write_text(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
