"""Predicted-KL step control at a 10x learning rate, for LoGRA, dense Adam
and LoRA, on the tiny task and reasoning-gym tasks.

Arms (each for every task and seed, all from the same warm-started policy;
the learning rates are the parity study's, times ``--lr-multiplier``):
  logra-1x                   LoGRA at its own learning rate (the reference)
  adam, logra, lora          at 10x, no KL control
  adam+kl, logra+kl, lora+kl at 10x with scale_by_predicted_kl(target_kl)

Every run records the realized KL of every step
(``logging.realized_kl_every=1``). Reports, per task and arm, the held-out
accuracy after training (mean and 95% CI over seeds), the realized KL (k3;
median and max), how often it stayed within 2x the target, the predicted
over the realized KL and the median step scale; a plot of the realized KL
per step (geometric mean over seeds with its 95% CI band, on a log axis;
steps that did not move the policy left out, nothing clipped) with the
target line and the band from half to twice the target, a legend on every
panel; and the compiled train step's time without and with the predictor
next to one forward pass (``overhead``, on the first task). Every report
records its provenance (commit, numerics fingerprint, date, machine,
versions, command).

Writes ``kl_control.csv``, ``kl_control.md`` and ``kl_control.png`` to
``experiments/results/kl_control/`` (``--results``). Finished runs are reused.

Run: python experiments/kl_control.py [--quick] [--seeds 3 (1 with --quick)]
     [--arms ...] [--tasks ...] [--target-kl 5e-3] [--out runs/kl_control]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import provenance
import study
from logra_jax import models
from logra_jax.rl import learner, scoring, setup
from logra_jax.rollout import engine
from logra_jax import policy_state

# Each optimizer's learning rate in the parity study.
LEARNING_RATES = {"adam": 3e-4, "logra": 3e-4, "lora": 3e-3}
ARMS = ["logra-1x"] + [
    f"{name}{control}"
    for control in ("", "+kl")
    for name in ("adam", "logra", "lora")
]


def arm_overrides(arm: str, args) -> list[str]:
  """Config overrides of one arm."""
  overrides = ["logging.realized_kl_every=1"]
  if arm == "logra-1x":
    return overrides + ["optimizer.name=logra"]
  name, _, control = arm.partition("+")
  overrides += [
      f"optimizer.name={name}",
      "optimizer.learning_rate="
      f"{args.lr_multiplier * LEARNING_RATES[name]:g}",
  ]
  if control == "kl":
    overrides += [
        f"optimizer.target_kl={args.target_kl}",
        f"optimizer.kl_subsample={args.kl_subsample}",
    ]
  return overrides


def kl_statistics(
    history: list[dict], target_kl: float, controlled: bool
) -> dict:
  """Realized KL per step and how often it stayed within 2x ``target_kl``;
  for a run under KL control, the predicted KL and the step scale too (NaN
  for the others, so that every row has the same columns)."""
  k1 = np.array([h["kl/realized"] for h in history])
  k3 = np.array([h["kl/realized_k3"] for h in history])
  nan = float("nan")
  predicted = np.array(
      [h["kl/predicted"] if controlled else nan for h in history]
  )
  return {
      "kl_k1_median": float(np.median(k1)),
      "kl_k3_median": float(np.median(k3)),
      "kl_k3_max": float(k3.max()),
      "k3_within_2x": float(np.mean(k3 <= 2 * target_kl)),
      "k1_within_2x": float(np.mean(k1 <= 2 * target_kl)),
      "k3_in_half_to_2x": float(
          np.mean((k3 >= target_kl / 2) & (k3 <= 2 * target_kl))
      ),
      # Over the steps that moved the policy (a skipped step has k3 = 0).
      "predicted_over_k3_median": float(
          np.median(predicted[k3 > 0] / k3[k3 > 0])
      ),
      "scale_median": (
          float(np.median([h["kl/scale"] for h in history]))
          if controlled
          else nan
      ),
      "skipped_steps": int(history[-1]["kl/skipped"]) if controlled else 0,
  }


def measure_overhead(config, repeats: int) -> str:
  """Train-step time without and with the KL predictor, and one forward."""
  task = setup.load_task(config)
  examples, _ = task.split(config.task.eval_size, seed=config.task.seed)
  policy = engine.Policy.load(
      setup.policy_folder(config, examples, log=lambda s: None)
  )
  batch, _ = scoring.rollout(
      policy,
      policy.params,
      list(examples[: config.rollout.prompts_per_step]),
      config,
      [(setup.task_verifier(task), 1.0)],
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
    tx = policy_state.make_optimizer(opt_config, policy.params)
    step = learner.make_train_step(
        policy.graphdef, tx, dataclasses.replace(config, optimizer=opt_config)
    )
    programs[label] = (
        (lambda step: lambda params, state: step(params, state, batch)[:2])(
            step
        ),
        policy_state.init_train_state(
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


def target_lines(ax, target_kl: float) -> None:
  """The target KL (dashed) and the band from half to twice it."""
  ax.axhline(target_kl, color="black", linestyle="--", label="target KL")
  ax.axhspan(
      target_kl / 2, 2 * target_kl, color="gray", alpha=0.15, label="0.5-2x"
  )


def main() -> None:
  parser = study.parser(__doc__.splitlines()[0], "kl_control")
  parser.add_argument("--arms", nargs="+", default=ARMS)
  parser.add_argument("--tasks", nargs="+", default=list(study.TASKS))
  parser.add_argument("--lr-multiplier", type=float, default=10.0)
  parser.add_argument("--target-kl", type=float, default=5e-3)
  parser.add_argument("--kl-subsample", type=int, default=128)
  parser.add_argument("--overhead-repeats", type=int, default=10)
  args = study.parse(parser)
  study.check_names(parser, "arms", args.arms, ARMS)
  study.check_names(parser, "tasks", args.tasks, study.TASKS)
  for name in ("lr_multiplier", "target_kl", "kl_subsample"):
    if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
      study.fail(f"--{name.replace('_', '-')} must be a finite number > 0")
  for task in args.tasks:  # every config checked before anything is written
    for arm in args.arms:
      study.run_config(
          args,
          study.task_overrides(args, task, 0) + arm_overrides(arm, args),
      )
  results = study.results_folder(args, "kl_control")
  record = study.provenance_record(args)
  rows, curves = [], {}
  for task in args.tasks:
    for arm in args.arms:
      for seed in range(args.seeds):
        run = study.run(args, arm, arm_overrides(arm, args), task, seed)
        rows.append(
            {
                "task": task,
                "arm": arm,
                "seed": seed,
                "eval_accuracy_before": run["summary"]["eval_accuracy_before"],
                "eval_accuracy_after": run["summary"]["eval_accuracy_after"],
                "optimizer_state_bytes": run["summary"][
                    "optimizer_state_bytes"
                ],
                **kl_statistics(
                    run["history"], args.target_kl, arm.endswith("+kl")
                ),
            }
        )
        curves.setdefault(task, {}).setdefault(arm, []).append(
            [(h["step"], h["kl/realized_k3"]) for h in run["history"]]
        )
  study.write_csv(rows, results / "kl_control.csv", record)
  lines = [
      f"Target KL {args.target_kl:g} per step; learning rates "
      f"{args.lr_multiplier:g}x the parity study's (logra-1x: 1x).",
      "",
      "| task | arm | held-out accuracy, mean [95% CI] "
      "| realized KL k3 (median / max) "
      "| steps with k3 <= 2x target | predicted / k3 | scale |",
      "|---|---|---:|---:|---:|---:|---:|",
  ]
  for task in args.tasks:
    for arm in args.arms:
      runs = [r for r in rows if r["task"] == task and r["arm"] == arm]
      mean = lambda key: statistics.mean(r[key] for r in runs)
      controlled = arm.endswith("+kl")
      lines.append(
          f"| {task} | {arm} "
          f"| {study.mean_ci([r['eval_accuracy_after'] for r in runs])} "
          f"| {mean('kl_k3_median'):.2e} / "
          f"{max(r['kl_k3_max'] for r in runs):.2e} "
          f"| {100 * mean('k3_within_2x'):.1f}% "
          + (
              f"| {mean('predicted_over_k3_median'):.2f} "
              f"| {mean('scale_median'):.3f} |"
              if controlled
              else "| - | - |"
          )
      )
  overhead_config = study.run_config(
      args,
      study.task_overrides(args, args.tasks[0], 0)
      + arm_overrides("logra+kl", args),
  )
  lines += [
      "",
      f"Overhead on {args.tasks[0]}: "
      + measure_overhead(
          overhead_config, 2 if args.quick else args.overhead_repeats
      ),
      "",
      provenance.footer(record),
  ]
  (results / "kl_control.md").write_text("\n".join(lines) + "\n")
  study.plot_bands(
      [(task, curves[task]) for task in args.tasks],
      "realized KL per step (k3)",
      results / "kl_control.png",
      record,
      geometric=True,
      decorate=lambda ax: target_lines(ax, args.target_kl),
  )
  study.write_provenance(record, results)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
