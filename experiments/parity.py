"""Reward parity: dense Adam, GaLore, LoRA and LoGRA on reasoning tasks.

Each arm trains the same warm-started tiny policy with GRPO on each task for
each seed (120 steps of 32 prompts x 8 completions on the tiny preset), and
the study reports the held-out accuracy after training (mean ± std over
seeds), the memory each arm holds for its weights and optimizer state (the
learner's weights as kept: dense float32, factored ``B, A, c`` or frozen
base plus adapters), learning curves with seed bands, and a plain verdict
per task: where LoGRA's mean accuracy is above, within or below each other
arm's (within = the difference is at most the larger of the two standard
deviations).

Arms: ``adam`` (dense AdamW), ``galore`` (optax.contrib.galore, rank 32),
``lora`` (AdamW on rank-32 adapters of every attention and MLP matrix, alpha
32, at 10x the learning rate: LoRA's best learning rate sits about an order
of magnitude above full fine-tuning's), ``logra`` (rank 32, sketch-direct
gradients, factored float32 base) and ``logra-bf16`` (the same on a
bfloat16 base). Tasks: ``tiny`` (the default ``chain_sum``), ``products``
(1-digit x 1-digit) and ``count_bits`` (1 bits of a number below 256), both
from reasoning-gym, scored by its verifiers.

Writes ``parity.csv``, ``parity.md`` and ``parity.png`` to
``experiments/results/parity/`` (``--results``). Finished runs are reused.

Run: python experiments/parity.py [--quick] [--seeds 3 (1 with --quick)]
     [--arms ...] [--tasks ...] [--set key=value ...] [--out runs/parity]
"""

from __future__ import annotations

import statistics

import study

ARMS: dict[str, list[str]] = {
    "adam": ["optimizer.name=adam"],
    "galore": ["optimizer.name=galore"],
    "lora": ["optimizer.name=lora", "optimizer.learning_rate=3e-3"],
    "logra": ["optimizer.name=logra"],
    "logra-bf16": ["optimizer.name=logra", "optimizer.base_dtype=bfloat16"],
}


def verdict(rows: list[dict], task: str, arms: list[str]) -> str:
  """Where LoGRA's mean accuracy on ``task`` is above, within or below each
  other arm's (within: the difference is at most the larger std)."""
  accuracy = {
      arm: [
          r["eval_accuracy_after"]
          for r in rows
          if r["task"] == task and r["arm"] == arm
      ]
      for arm in arms
  }
  spread = lambda a: statistics.stdev(a) if len(a) > 1 else 0.0
  words = []
  for arm in arms:
    if arm == "logra":
      continue
    difference = statistics.mean(accuracy["logra"]) - statistics.mean(
        accuracy[arm]
    )
    margin = max(spread(accuracy["logra"]), spread(accuracy[arm]))
    word = (
        "ties"
        if abs(difference) <= margin
        else "wins"
        if difference > 0
        else "loses"
    )
    words.append(f"{word} against {arm} ({difference:+.3f})")
  return f"{task}: LoGRA " + ", ".join(words) + "."


def main() -> None:
  parser = study.parser(__doc__.splitlines()[0], "parity")
  parser.add_argument("--arms", nargs="+", default=list(ARMS))
  parser.add_argument("--tasks", nargs="+", default=list(study.TASKS))
  args = study.parse(parser)
  study.check_names(parser, "arms", args.arms, ARMS)
  study.check_names(parser, "tasks", args.tasks, study.TASKS)
  if "logra" not in args.arms:
    parser.error("the arms must include logra (the verdicts compare to it)")
  results = study.results_folder(args, "parity")
  rows, curves = [], {}
  for task in args.tasks:
    for arm in args.arms:
      for seed in range(args.seeds):
        run = study.run(args, arm, ARMS[arm], task, seed)
        summary = run["summary"]
        rows.append(
            {
                "task": task,
                "arm": arm,
                "seed": seed,
                "eval_accuracy_before": summary["eval_accuracy_before"],
                "eval_accuracy_after": summary["eval_accuracy_after"],
                "weights_bytes": summary["weights_bytes"],
                "optimizer_state_bytes": summary["optimizer_state_bytes"],
                "num_params": summary["num_params"],
                "wall_seconds": summary["wall_seconds"],
            }
        )
        curves.setdefault(task, {}).setdefault(arm, []).append(run["history"])
  study.write_csv(rows, results / "parity.csv")
  mib = lambda b: f"{b / 2**20:.2f}"
  lines = [
      "| task | arm | held-out accuracy before | after (mean ± std) | "
      "weights + optimizer state, MiB (vs Adam) |",
      "|---|---|---:|---:|---:|",
  ]
  for task in args.tasks:
    first = {
        arm: next(r for r in rows if r["task"] == task and r["arm"] == arm)
        for arm in args.arms
    }
    memory = {
        arm: r["weights_bytes"] + r["optimizer_state_bytes"]
        for arm, r in first.items()
    }
    for arm in args.arms:
      runs = [r for r in rows if r["task"] == task and r["arm"] == arm]
      versus = (
          f" ({memory[arm] / memory['adam']:.2f})" if "adam" in memory else ""
      )
      lines.append(
          f"| {task} | {arm} | "
          f"{statistics.mean(r['eval_accuracy_before'] for r in runs):.3f} | "
          f"{study.mean_std([r['eval_accuracy_after'] for r in runs])} | "
          f"{mib(memory[arm])}{versus} |"
      )
  lines += ["", *(verdict(rows, task, args.arms) for task in args.tasks)]
  lines += ["", study.footer(study.command("parity", args))]
  (results / "parity.md").write_text("\n".join(lines) + "\n")
  study.plot_bands(
      [(task, curves[task]) for task in args.tasks],
      lambda row: row["reward/total"],
      "reward (mean ± std over seeds)",
      results / "parity.png",
  )
  print("\n".join(lines))


if __name__ == "__main__":
  main()
