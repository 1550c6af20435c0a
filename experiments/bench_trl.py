"""GRPO step time of `logra train` beside TRL's `GRPOTrainer` (CPU).

Both train the same policy (the warm-started `tiny` preset, loaded by
`transformers` from its folder for TRL) on the same prompts (the tiny
arithmetic task) with the same scorer (the task's verifier, called through
a TRL reward function): 16 prompts x 8 completions per step, learning rate
3e-4, no KL term (beta 0), float32, temperature 1. TRL uses AdamW without
gradient checkpointing; `logra train` runs with `optimizer.name=adam` and
with LoGRA. For each `--tokens` (max new tokens), each arm runs `--runs`
times in a fresh process, the arms alternating; the table gives the median
over runs of each run's median step time (steps 3 to `--steps`, after
compilation), the first step (compilation included) and the peak resident
memory of the process. A step is sampling, scoring and the update in every
arm (TRL generates inside its training step); ours also counts the sync of
the rollout engine.

Run it on an otherwise idle machine: PyTorch's OpenMP threads stall when
other processes compete for the cores. PyTorch gets as many threads as XLA
uses (every core) and flushes denormals to zero as XLA does. Needs `trl`
(`pip install -e ".[trl]"`); never part of the tests.

Writes `bench_trl.json` and `bench_trl.md` to
`experiments/results/bench_trl/` (`--results`).

Usage:
  python experiments/bench_trl.py [--tokens 6 32] [--steps 15] [--runs 2]
      [--arms trl adam logra]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import study

ARMS = ("trl", "adam", "logra")
PROMPTS, GENERATIONS, LEARNING_RATE = 16, 8, 3e-4
FIRST_TIMED_STEP = 3


def config(tokens: int, steps: int, optimizer: str = "adam"):
  """The run config of every arm (TRL reads its shared fields)."""
  from logra_jax import configs

  return configs.apply_overrides(
      configs.get_preset("tiny"),
      [
          f"steps={steps}",
          f"rollout.prompts_per_step={PROMPTS}",
          f"rollout.num_generations={GENERATIONS}",
          f"rollout.max_new_tokens={tokens}",
          f"optimizer.name={optimizer}",
          f"optimizer.learning_rate={LEARNING_RATE}",
          "optimizer.warmup_steps=0",
          "loss.beta=0.0",
          "eval_every=0",
          "logging.trackers=[]",
          "logging.samples_every=0",
      ],
  )


def _timed(step_seconds: list[float]) -> dict[str, float]:
  """A run's figures from its step times (in order)."""
  return {
      "median_step_s": statistics.median(step_seconds[FIRST_TIMED_STEP - 1 :]),
      "first_step_s": step_seconds[0],
      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
      / 2**20,
  }


def _worker_ours(optimizer: str, tokens: int, steps: int) -> dict:
  from logra_jax.rl import trainer

  with tempfile.TemporaryDirectory() as out:
    trainer.train(
        config(tokens, steps, optimizer),
        pathlib.Path(out) / "run",
        progress=False,
        log=lambda line: None,
    )
    history = [
        json.loads(line)
        for line in (pathlib.Path(out) / "run" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
  result = _timed([h["time/step_s"] for h in history])
  timed = history[FIRST_TIMED_STEP - 1 :]
  for name in ("train", "rollout"):
    result[f"median_{name}_s"] = statistics.median(
        h[f"time/{name}_s"] for h in timed
    )
  result["completion_length"] = statistics.mean(
      h["completion_length"] for h in history
  )
  result["compile_train_step"] = history[-1]["compile/train_step"]
  return result


def _worker_trl(tokens: int, steps: int) -> dict:
  import torch

  torch.set_num_threads(os.cpu_count())
  torch.set_flush_denormal(True)
  import datasets
  import transformers
  import trl

  from logra_jax.rl import rewards as rewards_lib
  from logra_jax.rl import setup

  run = config(tokens, steps)
  task = setup.load_task(run)
  train_examples, _ = task.split(run.task.eval_size, seed=run.task.seed)
  folder = setup.policy_folder(run, train_examples, print)
  rewards = setup.run_rewards(run, task)
  columns = [name for name in train_examples[0] if name != "prompt"]
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  # TRL tokenizes prompts without special tokens; ours start with BOS.
  prefix = tokenizer.bos_token or ""
  dataset = datasets.Dataset.from_list(
      [
          {"prompt": prefix + e["prompt"], **{c: e[c] for c in columns}}
          for e in train_examples[: steps * PROMPTS]
      ]
  )

  def task_reward(prompts, completions, **kwargs):
    report = rewards_lib.evaluate_rewards(
        rewards,
        [p[len(prefix) :] for p in prompts],
        list(completions),
        {c: list(kwargs[c]) for c in columns},
    )
    return [float(r) for r in report.rewards]

  step_seconds: list[float] = []

  class StepTimes(transformers.TrainerCallback):

    def on_step_begin(self, args, state, control, **kwargs):
      self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      step_seconds.append(time.perf_counter() - self.start)

  lengths: list[float] = []

  class Lengths(transformers.TrainerCallback):

    def on_log(self, args, state, control, logs=None, **kwargs):
      if logs and "completions/mean_length" in logs:
        lengths.append(logs["completions/mean_length"])

  with tempfile.TemporaryDirectory() as out:
    grpo = trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32
        ),
        reward_funcs=task_reward,
        args=trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS * GENERATIONS,
            num_generations=GENERATIONS,
            max_completion_length=tokens,
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            beta=0.0,
            temperature=1.0,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            seed=0,
        ),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes(), Lengths()],
    )
    grpo.train()
  result = _timed(step_seconds)
  result["completion_length"] = statistics.mean(lengths) if lengths else None
  return result


def _measure(arm: str, tokens: int, steps: int) -> dict:
  """One run of an arm in a fresh process."""
  out = subprocess.run(
      [sys.executable, __file__, "--worker", arm, str(tokens), str(steps)],
      capture_output=True,
      text=True,
      check=False,
  )
  if out.returncode:
    raise RuntimeError(
        f"{arm} at {tokens} new tokens failed:\n{out.stderr[-4000:]}"
    )
  return json.loads(out.stdout.strip().splitlines()[-1])


def _table(results: dict, args: argparse.Namespace) -> str:
  """The markdown table: per arm, the step time at each width (and its
  ratio to TRL's), the first step and the peak memory."""
  head = ["arm"] + [
      f"{tokens} new tokens: s/step (vs TRL)" for tokens in args.tokens
  ]
  head += [
      "first step, s",
      "peak RSS, GiB",
      "train + rollout, s/step",
  ]
  lines = [
      "| " + " | ".join(head) + " |",
      "|" + "---|" * len(head),
  ]
  median = lambda runs, key: statistics.median(r[key] for r in runs)
  for arm in args.arms:
    cells = [arm]
    for tokens in args.tokens:
      ours = median(results[arm][str(tokens)], "median_step_s")
      ratio = (
          f" ({ours / median(results['trl'][str(tokens)], 'median_step_s'):.2f})"
          if "trl" in results
          else ""
      )
      cells.append(f"{ours:.3f}{ratio}")
    runs = [r for t in args.tokens for r in results[arm][str(t)]]
    cells.append(
        " / ".join(
            f"{median(results[arm][str(t)], 'first_step_s'):.1f}"
            for t in args.tokens
        )
    )
    cells.append(
        f"{min(r['peak_rss_gib'] for r in runs):.2f}-"
        f"{max(r['peak_rss_gib'] for r in runs):.2f}"
    )
    cells.append(
        " / ".join(
            f"{median(results[arm][str(t)], 'median_train_s'):.3f} + "
            f"{median(results[arm][str(t)], 'median_rollout_s'):.3f}"
            for t in args.tokens
        )
        if arm != "trl"
        else "-"
    )
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[6, 32])
  parser.add_argument("--steps", type=int, default=15)
  parser.add_argument("--runs", type=int, default=2)
  parser.add_argument("--arms", nargs="+", default=list(ARMS))
  parser.add_argument(
      "--results", default=str(study.RESULTS / "bench_trl"), type=pathlib.Path
  )
  parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    arm, tokens, steps = (
        args.worker[0],
        int(args.worker[1]),
        int(args.worker[2]),
    )
    result = (
        _worker_trl(tokens, steps)
        if arm == "trl"
        else _worker_ours(arm, tokens, steps)
    )
    print(json.dumps(result))
    return
  study.check_names(parser, "arms", args.arms, ARMS)
  if args.steps <= FIRST_TIMED_STEP:
    parser.error(f"--steps must be > {FIRST_TIMED_STEP}, got {args.steps}")
  if "trl" in args.arms:
    try:
      import trl  # noqa: F401
    except ImportError:
      parser.error("the trl arm needs trl: pip install -e '.[trl]'")
  # The warm-started policy, made once before anything is timed.
  from logra_jax.rl import setup

  run = config(args.tokens[0], args.steps)
  setup.policy_folder(
      run,
      setup.load_task(run).split(run.task.eval_size, seed=run.task.seed)[0],
      print,
  )
  results: dict = {arm: {str(t): [] for t in args.tokens} for arm in args.arms}
  for tokens in args.tokens:
    for repeat in range(args.runs):
      for arm in args.arms if repeat % 2 == 0 else args.arms[::-1]:
        result = _measure(arm, tokens, args.steps)
        results[arm][str(tokens)].append(result)
        print(f"{tokens} new tokens, {arm}: {json.dumps(result)}", flush=True)
  command = " ".join(["python experiments/bench_trl.py"] + sys.argv[1:])
  table = _table(results, args)
  args.results.mkdir(parents=True, exist_ok=True)
  (args.results / "bench_trl.json").write_text(
      json.dumps({"command": command, "results": results}, indent=1) + "\n"
  )
  load = os.getloadavg()[0]
  (args.results / "bench_trl.md").write_text(
      f"{table}\n\n{study.footer(command)} Load average at the end: "
      f"{load:.2f}.\n"
  )
  print(table)


if __name__ == "__main__":
  main()
