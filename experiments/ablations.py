"""Ablations of LoGRA on the tiny task: rank, refresh interval, projector
kind, moment policy.

Each arm changes one setting of the default (rank 32, refresh every 50
steps, ``kind=range``, ``moment_policy=transfer``) and trains the same
warm-started tiny policy with GRPO for each seed (120 steps of 32 prompts x
8 completions). Reports the held-out accuracy after training (mean and 95%
CI over seeds), the optimizer state and the median step time beside the
default's, and reward curves (mean with its 95% CI band over seeds, a legend
on every panel). Every report records its provenance (commit, numerics
fingerprint, date, machine, versions, command).

Writes ``ablations.csv``, ``ablations.md`` and ``ablations.png`` to
``experiments/results/ablations/`` (``--results``). Finished runs are
reused.

Run: python experiments/ablations.py [--quick] [--seeds 3 (1 with --quick)]
     [--arms ...] [--tasks tiny] [--set key=value ...] [--out runs/ablations]
"""

from __future__ import annotations

import statistics

import provenance
import study

DEFAULT = "default"  # rank 32, refresh 50, range projectors, transfer
# Groups of arms, each a one-setting change of the default.
GROUPS: dict[str, dict[str, list[str]]] = {
    "rank": {
        "rank=8": ["optimizer.rank=8"],
        "rank=128": ["optimizer.rank=128"],
    },
    "refresh interval": {
        "refresh_every=10": ["optimizer.refresh_every=10"],
        "refresh_every=200": ["optimizer.refresh_every=200"],
    },
    "projector kind": {
        "kind=random": ["optimizer.kind=random"],
        "kind=svd": ["optimizer.kind=svd"],
    },
    "moment policy": {
        "moment_policy=keep": ["optimizer.moment_policy=keep"],
        "moment_policy=reset": ["optimizer.moment_policy=reset"],
    },
}
ARMS = {DEFAULT: [], **{a: o for g in GROUPS.values() for a, o in g.items()}}


def arm_overrides(arm: str, quick: bool) -> list[str]:
  """An arm's overrides; with ``--quick`` its rank shrinks 8x (at least 1)
  to fit the smoke policy, 64 wide, whose own rank is 4."""
  if not quick:
    return ARMS[arm]
  return [
      (
          f"optimizer.rank={max(1, int(o.split('=')[1]) // 8)}"
          if o.startswith("optimizer.rank=")
          else o
      )
      for o in ARMS[arm]
  ]


def main() -> None:
  parser = study.parser(__doc__.splitlines()[0], "ablations")
  parser.add_argument("--arms", nargs="+", default=list(ARMS))
  parser.add_argument("--tasks", nargs="+", default=["tiny"])
  args = study.parse(parser)
  study.check_names(parser, "arms", args.arms, ARMS)
  study.check_names(parser, "tasks", args.tasks, study.TASKS)
  if DEFAULT not in args.arms:
    study.fail(f"the arms must include {DEFAULT!r} (the reference)")
  for task in args.tasks:  # every config checked before anything is written
    for arm in args.arms:
      study.run_config(
          args,
          study.task_overrides(args, task, 0)
          + ["optimizer.name=logra", *arm_overrides(arm, args.quick)],
      )
  results = study.results_folder(args, "ablations")
  record = study.provenance_record(args)
  rows, curves = [], {}
  for task in args.tasks:
    for arm in args.arms:
      for seed in range(args.seeds):
        run = study.run(
            args,
            arm,
            ["optimizer.name=logra", *arm_overrides(arm, args.quick)],
            task,
            seed,
        )
        summary, history = run["summary"], run["history"]
        steady = [m["time/step_s"] for m in history[2:]] or [
            m["time/step_s"] for m in history
        ]
        rows.append(
            {
                "task": task,
                "arm": arm,
                "seed": seed,
                "eval_accuracy_before": summary["eval_accuracy_before"],
                "eval_accuracy_after": summary["eval_accuracy_after"],
                "optimizer_state_bytes": summary["optimizer_state_bytes"],
                "step_s_median": statistics.median(steady),
            }
        )
        curves.setdefault(task, {}).setdefault(arm, []).append(
            [(h["step"], h["reward/total"]) for h in history]
        )
  study.write_csv(rows, results / "ablations.csv", record)
  lines = [
      "| task | group | arm | held-out accuracy after, mean [95% CI] | "
      "optimizer state, KiB | median s/step (vs default) |",
      "|---|---|---|---:|---:|---:|",
  ]
  for task in args.tasks:
    of = lambda arm: [r for r in rows if r["task"] == task and r["arm"] == arm]
    reference = statistics.median(r["step_s_median"] for r in of(DEFAULT))
    for group, arms in [("reference", [DEFAULT]), *GROUPS.items()]:
      for arm in (a for a in arms if a in args.arms):
        runs = of(arm)
        step = statistics.median(r["step_s_median"] for r in runs)
        lines.append(
            f"| {task} | {group} | {arm} | "
            f"{study.mean_ci([r['eval_accuracy_after'] for r in runs])} | "
            f"{runs[0]['optimizer_state_bytes'] / 2**10:.0f} | "
            f"{step:.3f} ({step / reference:.2f}) |"
        )
  lines += ["", provenance.footer(record)]
  (results / "ablations.md").write_text("\n".join(lines) + "\n")
  study.plot_bands(
      [
          (
              f"{task}: {group}",
              {a: curves[task][a] for a in [DEFAULT, *arms] if a in args.arms},
          )
          for task in args.tasks
          for group, arms in GROUPS.items()
          if any(a in args.arms for a in arms)
      ],
      "training reward (mean, 95% CI over seeds)",
      results / "ablations.png",
      record,
  )
  study.write_provenance(record, results)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
