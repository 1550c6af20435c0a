"""The shipped loss recipes against the default job: held-out accuracy and
step time of `logra train --config <recipe>` beside plain `logra train`.

Each arm is the main job (the tiny preset: a warm-started ~1M-parameter
decoder, GRPO with LoGRA on chain_sum, 260 steps of 64 prompts x 8
completions) with one shipped recipe of `logra train --list-recipes`
layered on it, exactly as `logra train --config <recipe>` does; `default`
is the main job as it is. For every seed: the held-out accuracy before and
after (and during training, every `eval_every` steps), the median step
time after the first two steps (compiles). Step times are only comparable
between runs on an otherwise idle machine: say in the results when it was
shared. Reports the mean and 95% CI over seeds and each recipe's
step time as a ratio to the default's.

Writes ``recipes.csv``, ``recipes.md`` and ``recipes.png`` (held-out
accuracy during training, 95% CI bands) to ``experiments/results/recipes/``
(``--results``). Finished runs are reused when config and numerics
fingerprint match.

Run: python experiments/recipes.py [--quick] [--seeds 2 (1 with --quick)]
     [--arms default dapo gspo] [--set key=value ...] [--out runs/recipes]
"""

from __future__ import annotations

import pathlib
import statistics

import provenance
import study
from logra_jax import configs

DEFAULT = "default"
ARMS = [DEFAULT, *configs.recipe_names()]


def run_config(args, arm: str, seed: int):
  """The main job's config (``smoke`` with ``--quick``) with ``arm``'s recipe
  file, the seed and ``--set``; bad input exits (status 2)."""
  preset = "smoke" if args.quick else "tiny"
  files = [] if arm == DEFAULT else [arm]
  try:
    return configs.load_config(preset, files, [f"seed={seed}", *args.set])
  except ValueError as error:
    study.fail(" ".join(str(error).split()))


def measure(args, arm: str, seed: int) -> tuple[dict, list]:
  """One run (reused when finished): its row and held-out curve."""
  out = pathlib.Path(args.out) / ("quick" if args.quick else "full")
  result = study.train(
      args, run_config(args, arm, seed), out / f"{arm}-seed{seed}"
  )
  summary, history = result["summary"], result["history"]
  steady = history[2:] or history  # the first two steps compile
  median = lambda key: statistics.median(m[key] for m in steady)
  row = {
      "arm": arm,
      "seed": seed,
      "held_out_before": summary["eval_accuracy_before"],
      "held_out_after": summary["eval_accuracy_after"],
      "step_s_median": median("time/step_s"),
      "rollout_s_median": median("time/rollout_s"),
      "train_s_median": median("time/train_s"),
      "resample_rounds_mean": statistics.fmean(
          m.get("rollout/resample_rounds", 0.0) for m in history
      ),
      "steps": len(history),
  }
  curve = [(0, summary["eval_accuracy_before"])] + [
      (m["step"], m["accuracy/eval"]) for m in history if "accuracy/eval" in m
  ]
  print(
      f"{arm} seed {seed}: held-out {row['held_out_before']:.3f} -> "
      f"{row['held_out_after']:.3f}, {row['step_s_median']:.3f} s/step",
      flush=True,
  )
  return row, curve


def table(args, rows: list[dict], record: dict) -> str:
  """The markdown: per arm, held-out accuracy with CIs, step time ratio."""
  of = lambda arm: [r for r in rows if r["arm"] == arm]
  reference = statistics.median(r["step_s_median"] for r in of(DEFAULT))
  lines = [
      "Held-out accuracy: mean [95% CI] over seeds (Student t); step time: "
      "median over the runs' steps after the first two, then over seeds.",
      "",
      "| arm | seeds | held-out before | held-out after "
      "| median s/step (vs default) | rollout s / train s "
      "| resample rounds per step |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for arm in args.arms:
    runs = of(arm)
    step = statistics.median(r["step_s_median"] for r in runs)
    of_runs = lambda key: statistics.median(r[key] for r in runs)
    lines.append(
        f"| {arm} | {len(runs)} "
        f"| {statistics.fmean(r['held_out_before'] for r in runs):.3f} "
        f"| {study.mean_ci([r['held_out_after'] for r in runs])} "
        f"| {step:.3f} ({step / reference:.2f}x) "
        f"| {of_runs('rollout_s_median'):.3f} / "
        f"{of_runs('train_s_median'):.3f} "
        f"| {of_runs('resample_rounds_mean'):.2f} |"
    )
  lines += ["", provenance.footer(record)]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = study.parser(
      __doc__.splitlines()[0], "recipes", "seeds per arm (2; 1 with --quick)"
  )
  parser.add_argument("--arms", nargs="+", default=[DEFAULT, "dapo", "gspo"])
  args = parser.parse_args()
  if args.seeds is None:
    args.seeds = 1 if args.quick else 2
  if args.seeds < 1:
    study.fail(f"--seeds must be >= 1, got {args.seeds}")
  study.check_names(parser, "arms", args.arms, ARMS)
  if DEFAULT not in args.arms:
    study.fail(f"the arms must include {DEFAULT!r} (the reference)")
  for arm in args.arms:  # every config checked before anything is written
    run_config(args, arm, 0)
  results = study.results_folder(args, "recipes")
  record = study.provenance_record(args)
  rows, curves = [], {}
  for seed in range(args.seeds):
    for arm in args.arms:
      row, curve = measure(args, arm, seed)
      rows.append(row)
      curves.setdefault(arm, []).append(curve)
  study.write_csv(rows, results / "recipes.csv", record)
  text = table(args, rows, record)
  (results / "recipes.md").write_text(text)
  study.plot_bands(
      [("main job: held-out accuracy during training", curves)],
      "held-out accuracy (mean, 95% CI over seeds)",
      results / "recipes.png",
      record,
  )
  study.write_provenance(record, results)
  print(text)


if __name__ == "__main__":
  main()
