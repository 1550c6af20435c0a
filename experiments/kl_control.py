"""Predicted-KL step control on the tiny RL task at a 10x learning rate.

Arms (each for several seeds, all from the same warm-started policy):
  logra-1x   LoGRA at the default learning rate (the reference)
  adam       dense Adam at 10x the default learning rate, no KL control
  logra      LoGRA at 10x, no KL control
  logra+kl   LoGRA at 10x with scale_by_predicted_kl(target_kl)
  adam+kl    dense Adam at 10x with scale_by_predicted_kl(target_kl)

Writes to the output folder: one run folder per arm and seed,
`kl_control.csv` (one row per run), `kl_control.md` (per-arm mean ± std of the
held-out accuracy and the KL statistics), `kl_control.png` (realized KL per
step and held-out accuracy), and `overhead.md`: the compiled train step's time
without and with the predictor next to one forward pass on the same batch.
Finished runs whose `config.yaml` matches are reused (`--rerun` to redo them).

Run: python experiments/kl_control.py [--seeds 0 1 2] [--steps 125]
     [--target-kl 5e-3] [--arms logra-1x adam logra logra+kl adam+kl]
     [--out runs/kl_control]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import models
from logra_jax.configs import train as train_config
from logra_jax.rl import learner, trainer
from logra_jax.rollout import engine


def arm_overrides(
    arm: str, lr: float, target_kl: float, kl_subsample: int
) -> list[str]:
  """`--set` overrides of one arm."""
  name, _, control = arm.partition("+")
  if name == "logra-1x":
    return []
  overrides = [f"optimizer.name={name}", f"optimizer.learning_rate={lr}"]
  if control == "kl":
    overrides += [
        f"optimizer.target_kl={target_kl}",
        f"optimizer.kl_subsample={kl_subsample}",
    ]
  return overrides


def run_arm(
    config, folder: pathlib.Path, rerun: bool
) -> tuple[list[dict], dict]:
  """Trains (or reuses a finished run); returns per-step metrics and the
  summary."""
  summary = trainer.train_or_reuse(config, folder, rerun)
  history = [
      json.loads(line)
      for line in (folder / "metrics.jsonl").read_text().splitlines()
  ]
  return history, summary


def kl_statistics(history: list[dict], target_kl: float | None) -> dict:
  """Realized and predicted KL per step, and how often the target held."""
  k1 = np.array([h["kl/realized"] for h in history])
  k3 = np.array([h["kl/realized_k3"] for h in history])
  stats = {
      "kl_k1_median": float(np.median(k1)),
      "kl_k3_median": float(np.median(k3)),
      "kl_k3_max": float(k3.max()),
  }
  if target_kl is not None:
    predicted = np.array([h["kl/predicted"] for h in history])
    stats.update(
        {
            "k3_within_2x": float(np.mean(k3 <= 2 * target_kl)),
            "k1_within_2x": float(np.mean(k1 <= 2 * target_kl)),
            "k3_in_half_to_2x": float(
                np.mean((k3 >= target_kl / 2) & (k3 <= 2 * target_kl))
            ),
            "predicted_over_k3_median": float(np.median(predicted / k3)),
            "scale_median": float(np.median([h["kl/scale"] for h in history])),
            "skipped_steps": int(history[-1]["kl/skipped"]),
        }
    )
  return stats


def measure_overhead(config, repeats: int) -> str:
  """Train-step time without and with the KL predictor, and one forward."""
  task = trainer.load_task(config)
  examples, _ = task.split(config.task.eval_size, seed=config.task.seed)
  policy = engine.Policy.load(
      trainer.policy_folder(config, examples, log=lambda s: None)
  )
  batch, _ = engine.rollout(
      policy,
      policy.params,
      list(examples[: config.rollout.prompts_per_step]),
      config,
      [(trainer.task_verifier(task), 1.0)],
      jax.random.key(0),
  )
  forward = jax.jit(
      lambda params, state: (
          models.token_logprobs(
              policy.graphdef,
              params,
              batch.prompt_tokens_BxP,
              batch.prompt_mask_BxP,
              batch.completion_tokens_BxT,
              batch.completion_mask_BxT,
          ),
          state,
      )
  )
  programs = {
      "forward pass (log-probs)": (
          forward,
          (jax.tree.map(jnp.copy, policy.params), None),
      )
  }
  for label, opt_config in [
      (
          "train step, no KL control",
          dataclasses.replace(config.optimizer, target_kl=None),
      ),
      (
          "train step + predictor (all sequences)",
          dataclasses.replace(config.optimizer, kl_subsample=None),
      ),
      (
          f"train step + predictor ({config.optimizer.kl_subsample} sequences)",
          config.optimizer,
      ),
  ]:
    tx = learner.make_optimizer(opt_config, policy.params)
    step = learner.make_train_step(
        policy.graphdef, tx, dataclasses.replace(config, optimizer=opt_config)
    )
    programs[label] = (
        (lambda step: lambda params, state: step(params, state, batch)[:2])(
            step
        ),
        learner.init_train_state(
            opt_config, tx, jax.tree.map(jnp.copy, policy.params)
        ),
    )
  times = {label: [] for label in programs}
  params = {label: start[0] for label, (_, start) in programs.items()}
  states = {label: start[1] for label, (_, start) in programs.items()}
  for i in range(repeats + 1):  # the first round compiles
    for label, (fn, _) in programs.items():
      start = time.perf_counter()
      new_params, states[label] = jax.block_until_ready(
          fn(params[label], states[label])
      )
      if label != "forward pass (log-probs)":
        params[label] = new_params
      if i:
        times[label].append(time.perf_counter() - start)
  base = statistics.median(times["train step, no KL control"])
  lines = [
      f"{batch.batch_size} completions of <= "
      f"{config.rollout.max_new_tokens} tokens; median of {repeats}",
      "",
      "| program | ms | vs train step |",
      "|---|---:|---:|",
  ]
  for label, values in times.items():
    ms = statistics.median(values)
    lines.append(f"| {label} | {1e3 * ms:.1f} | {ms / base:.2f} |")
  return "\n".join(lines)


def plot(
    histories: dict[str, list[tuple[list[dict], list]]],
    target_kl: float,
    path: pathlib.Path,
) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
  for (arm, runs), color in zip(histories.items(), plt.cm.tab10.colors):
    for i, (history, evals) in enumerate(runs):
      steps = [h["step"] for h in history]
      axes[0].plot(
          steps,
          [max(h["kl/realized_k3"], 1e-7) for h in history],
          color=color,
          alpha=0.6,
          lw=0.8,
          label=arm if i == 0 else None,
      )
      axes[1].plot(
          *zip(*evals),
          "o-",
          color=color,
          alpha=0.7,
          ms=3,
          label=arm if i == 0 else None,
      )
  axes[0].axhline(target_kl, color="k", ls="--", lw=1, label="target")
  axes[0].axhline(2 * target_kl, color="k", ls=":", lw=1, label="2x target")
  axes[0].set_yscale("log")
  axes[0].set_title("realized KL per step (k3)")
  axes[1].set_title("held-out accuracy")
  for ax in axes:
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument(
      "--arms",
      nargs="+",
      default=["logra-1x", "adam", "logra", "logra+kl", "adam+kl"],
  )
  parser.add_argument("--steps", type=int, default=125)
  parser.add_argument("--lr-multiplier", type=float, default=10.0)
  parser.add_argument("--target-kl", type=float, default=5e-3)
  parser.add_argument("--kl-subsample", type=int, default=128)
  parser.add_argument("--overhead-repeats", type=int, default=10)
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--out", default="runs/kl_control")
  parser.add_argument("--rerun", action="store_true")
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  base = train_config.apply_overrides(
      train_config.get_preset(args.preset),
      # The realized KL of every step, beside the predicted one.
      ["logging.realized_kl_every=1"] + args.set + [f"steps={args.steps}"],
  )
  lr = args.lr_multiplier * base.optimizer.learning_rate
  histories: dict[str, list[tuple[list[dict], list]]] = {}
  rows = []
  for arm in args.arms:
    for seed in args.seeds:
      config = train_config.apply_overrides(
          base,
          arm_overrides(arm, lr, args.target_kl, args.kl_subsample)
          + [f"seed={seed}"],
      )
      history, summary = run_arm(config, out / f"{arm}-seed{seed}", args.rerun)
      evals = (
          [(0, summary["eval_accuracy_before"])]
          + [
              (h["step"], h["accuracy/eval"])
              for h in history
              if "accuracy/eval" in h
          ]
          + [(len(history), summary["eval_accuracy_after"])]
      )
      histories.setdefault(arm, []).append((history, evals))
      row = {
          "arm": arm,
          "seed": seed,
          "eval_accuracy_after": summary["eval_accuracy_after"],
          **kl_statistics(history, config.optimizer.target_kl),
      }
      rows.append(row)
      print(json.dumps(row), flush=True)

  fields = list(dict.fromkeys(k for row in rows for k in row))
  with open(out / "kl_control.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)

  def mean_std(values, fmt):
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):{fmt}} ± {std:{fmt}}"

  lines = [
      f"target KL {args.target_kl:g} per step, learning rate {lr:g} "
      f"({args.lr_multiplier:g}x; logra-1x: "
      f"{base.optimizer.learning_rate:g}), {args.steps} steps, seeds "
      f"{args.seeds}",
      "",
      "| arm | held-out accuracy | realized KL k3 (median / max) "
      "| steps with k3 <= 2x target | k3 in [target/2, 2x target] "
      "| predicted / k3 | scale |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for arm in args.arms:
    arm_rows = [r for r in rows if r["arm"] == arm]
    controlled = "k3_within_2x" in arm_rows[0]
    k3_within = [r.get("k3_within_2x") for r in arm_rows]
    uncontrolled_within = [
        float(
            np.mean(
                [h["kl/realized_k3"] <= 2 * args.target_kl for h in history]
            )
        )
        for history, _ in histories[arm]
    ]
    cells = [
        arm,
        mean_std([r["eval_accuracy_after"] for r in arm_rows], ".3f"),
        f"{statistics.mean(r['kl_k3_median'] for r in arm_rows):.2e} / "
        f"{max(r['kl_k3_max'] for r in arm_rows):.2e}",
        f"{100 * statistics.mean(k3_within if controlled else uncontrolled_within):.1f}%",
        (
            f"{100 * statistics.mean(r['k3_in_half_to_2x'] for r in arm_rows):.1f}%"
            if controlled
            else "-"
        ),
        (
            f"{statistics.mean(r['predicted_over_k3_median'] for r in arm_rows):.2f}"
            if controlled
            else "-"
        ),
        (
            f"{statistics.mean(r['scale_median'] for r in arm_rows):.3f}"
            if controlled
            else "-"
        ),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  table = "\n".join(lines)
  (out / "kl_control.md").write_text(table + "\n")
  print(table)
  plot(histories, args.target_kl, out / "kl_control.png")

  overhead_config = train_config.apply_overrides(
      base, arm_overrides("logra+kl", lr, args.target_kl, args.kl_subsample)
  )
  overhead = measure_overhead(overhead_config, args.overhead_repeats)
  (out / "overhead.md").write_text(overhead + "\n")
  print(overhead)


if __name__ == "__main__":
  main()
