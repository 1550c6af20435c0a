"""Does the whole system fit on one device: the learner's train step plus the
colocated rollout engine at its real cost, planned by `logra memory`.

Two questions, each a list of plans on one device (mesh fsdp=1), LoGRA
with sketch-direct gradients, the embedding table and LM head projected and
a bfloat16 base (factored weights ``W = c B + P A``), block remat:

(a) Qwen2.5-7B GRPO with a colocated rollout of 64 x 1024 tokens in 24 GiB:
    the issue's command (rank 32, seq 2048, micro-batch 1), the same under
    predicted-KL step control (``--target-kl``: the KL predictor's
    temporaries inside the step), rank 8, and smaller settings (seq 1024,
    fewer rollout sequences).
(b) qwen3-style-27b (27.2B parameters) with a colocated rollout of 64 x 1024
    tokens on one 141 GB device (an H200: 141e9 bytes = 131.3 GiB), over
    seq 1024 / 2048 / 4096 and micro-batch 1 / 2 / 4. A point is skipped
    (and marked so) when a point with no larger seq and micro-batch did not
    fit: memory grows with both.

The colocated engine samples with the learner's own arrays (zero-copy, the
default engine): its reservation is the sampling program's temporaries and
outputs, the KV cache among them (``memory.shared_rollout_bytes``). It
depends on the model, the optimizer's layout and the rollout shape, not on
the train step's seq or micro-batch, so it is compiled once per model,
rank and rollout shape. The zero-copy engine samples between train steps
(``rollout.max_staleness=0`` has no rollout thread), so the system's peak
is the resident state (weights, optimizer state) plus the larger of the two
phases: the step's batch, gradients, temporaries and outputs, or the
engine's reservation (``logra memory`` with the row's command computes the
same total in one plan). Beside it, the asynchronous engine's own bfloat16 copy of the
weights plus its KV cache (``memory.rollout_reservation``, ``logra memory
--rollout-copy``). Each row gives the exact ``logra memory`` command that
reproduces it. Writes ``question_a.md`` / ``question_b.md`` (with a
provenance footer: commit, date, machine, versions, the command) and
``question_a.json`` / ``question_b.json`` under ``--results`` (default
``experiments/results/system_memory/``).

With ``--compile-for h200`` every plan is XLA:GPU's, compiled for the GPU
without one (``logra memory --compile-for``; results by default under
``experiments/results/system_memory/h200/``).

Run: python experiments/system_memory.py [--questions a b]
     [--results experiments/results/system_memory] [--compile-for h200]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import provenance
import study

from logra_jax import memory
from logra_jax import parallel

GIB = 2**30
H200_GIB = 141e9 / GIB
ROLLOUT = (64, 1024)
TARGET_KL = 0.01
# (model, device GiB, rank, seq, micro-batch, rollout seqs x tokens, target
# KL or None)
QUESTION_A = [
    ("qwen2.5-7b", 24.0, 32, 2048, 1, ROLLOUT, None),
    ("qwen2.5-7b", 24.0, 32, 2048, 1, ROLLOUT, TARGET_KL),
    ("qwen2.5-7b", 24.0, 8, 2048, 1, ROLLOUT, None),
    ("qwen2.5-7b", 24.0, 8, 1024, 1, ROLLOUT, None),
    ("qwen2.5-7b", 24.0, 8, 1024, 1, (16, 1024), None),
]
GRID_B = [(seq, mb) for seq in (1024, 2048, 4096) for mb in (1, 2, 4)]


def command(
    model,
    device_gib,
    rank,
    seq,
    micro_batch,
    rollout,
    target_kl,
    compile_for=None,
) -> str:
  """The ``logra memory`` command of one plan."""
  return (
      f"logra memory --model {model} --mesh fsdp=1 --seq {seq} "
      f"--micro-batch {micro_batch} --optimizer logra --rank {rank} "
      "--project-embeddings --base-dtype bfloat16 "
      f"--rollout-seqs {rollout[0]} --rollout-tokens {rollout[1]} "
      f"--device-memory-gib {device_gib:.1f}"
      + (f" --target-kl {target_kl}" if target_kl else "")
      + (f" --compile-for {compile_for}" if compile_for else "")
  )


def plan(
    question: str,
    point: tuple,
    rollouts: dict[tuple, int],
    compile_for: str | None = None,
) -> dict:
  """One row: the train step's plan plus the colocated engine's
  reservation (compiled once per model, rank and rollout shape, kept in
  ``rollouts``) and the asynchronous engine's own copy; compiled for the
  GPU ``compile_for`` names, or the devices here."""
  model, device_gib, rank, seq, micro_batch, rollout, target_kl = point
  key = (model, rank, rollout)
  report = memory.plan_memory(
      model,
      mesh=parallel.MeshConfig(),
      optimizer="logra",
      rank=rank,
      seq_len=seq,
      micro_batch=micro_batch,
      rollout_seqs=0 if key in rollouts else rollout[0],
      rollout_tokens=0 if key in rollouts else rollout[1],
      project_embeddings=True,
      base_dtype="bfloat16",
      target_kl=target_kl,
      compile_for=compile_for,
  )
  rollouts.setdefault(key, report.rollout)
  step, train = report.step_phase, report.train_total
  system = report.with_rollout(rollouts[key]).total
  copy = memory.rollout_reservation(
      memory.load_model_config(model), parallel.MeshConfig(), *rollout
  )
  limit = int(device_gib * GIB)
  row = {
      "question": question,
      "model": model,
      "device_gib": round(device_gib, 2),
      "rank": rank,
      "seq": seq,
      "micro_batch": micro_batch,
      "rollout": f"{rollout[0]}x{rollout[1]}",
      "target_kl": target_kl,
      "params": report.params,
      "optimizer_state": report.optimizer_state,
      "temporaries": report.temporaries,
      "train_total": train,
      "rollout_zero_copy": rollouts[key],
      "step_phase": step,
      "system_total": system,
      "fits": system <= limit,
      "rollout_own_copy": copy,
      "system_own_copy_total": train + copy,
      "own_copy_fits": train + copy <= limit,
      "command": command(*point, compile_for),
  }
  print(json.dumps(row), flush=True)
  return row


def grid_b(
    rollouts: dict[tuple, int], compile_for: str | None = None
) -> list[dict]:
  """Question (b) over seq x micro-batch, skipping points dominated by one
  that did not fit."""
  rows, failed = [], []
  for seq, mb in GRID_B:
    point = ("qwen3-style-27b", H200_GIB, 32, seq, mb, ROLLOUT, None)
    if any(seq >= s and mb >= m for s, m in failed):
      rows.append(
          {
              "question": "b",
              "seq": seq,
              "micro_batch": mb,
              "skipped": "a point with no larger seq and micro-batch did not fit",
              "command": command(*point, compile_for),
          }
      )
      continue
    rows.append(plan("b", point, rollouts, compile_for))
    if not rows[-1]["fits"]:
      failed.append((seq, mb))
  return rows


def markdown(rows: list[dict]) -> str:
  """The rows as a markdown table (GiB per device)."""
  gib = lambda b: f"{b / GIB:.2f}"
  lines = [
      "GiB per device, one device (fsdp=1); LoGRA, sketch-direct gradients, "
      "embeddings projected, bfloat16 base, block remat. System = train "
      "step's resident state (weights, optimizer state) + the larger of "
      "the step's phase (batch, gradients, temporaries, outputs) and the "
      "colocated zero-copy engine's reservation (the default engine samples "
      "with the learner's arrays between steps; reservation = the sampling "
      "program's temporaries and outputs, KV cache included). Own copy = the asynchronous "
      "engine's bfloat16 weights + KV cache, for comparison.",
      "",
      "| question | model | device GiB | rank | seq | micro-batch | rollout "
      "| target KL | params | optimizer state | temporaries | train step | zero-copy "
      "engine | **system** | fits | train step + own-copy engine | fits "
      "| command |",
      "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
      "---|---:|---|---|",
  ]
  for r in rows:
    if "skipped" in r:
      lines.append(
          f"| {r['question']} | qwen3-style-27b | {H200_GIB:.2f} | 32 | "
          f"{r['seq']} | {r['micro_batch']} | {ROLLOUT[0]}x{ROLLOUT[1]} | - | "
          f"skipped: {r['skipped']} ||||||||| `{r['command']}` |"
      )
      continue
    lines.append(
        f"| {r['question']} | {r['model']} | {r['device_gib']:.2f} | "
        f"{r['rank']} | {r['seq']} | {r['micro_batch']} | {r['rollout']} | "
        f"{r['target_kl'] or '-'} | {gib(r['params'])} | {gib(r['optimizer_state'])} | "
        f"{gib(r['temporaries'])} | {gib(r['train_total'])} | "
        f"{gib(r['rollout_zero_copy'])} | **{gib(r['system_total'])}** | "
        f"{'yes' if r['fits'] else 'no'} | "
        f"{gib(r['system_own_copy_total'])} | "
        f"{'yes' if r['own_copy_fits'] else 'no'} | `{r['command']}` |"
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--questions", nargs="+", choices=["a", "b"], default=["a", "b"]
  )
  parser.add_argument(
      "--results",
      type=pathlib.Path,
      default=None,
      help="folder for question_{a,b}.md and .json (default "
      "experiments/results/system_memory/, with --compile-for its "
      "subfolder of that GPU's name)",
  )
  parser.add_argument(
      "--compile-for",
      choices=memory.GPU_TARGETS,
      default=None,
      help="compile for this GPU without one (logra memory --compile-for)",
  )
  args = parser.parse_args()
  if args.results is None:
    args.results = study.RESULTS / "system_memory" / (args.compile_for or "")
  for question in args.questions:
    rollouts: dict[tuple, int] = {}
    if question == "a":
      rows = [
          plan("a", point, rollouts, args.compile_for) for point in QUESTION_A
      ]
    else:
      rows = grid_b(rollouts, args.compile_for)
    record = provenance.collect(provenance.this_command(), "not computed")
    text = markdown(rows) + "\n\n" + provenance.footer(record) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"question_{question}.md").write_text(text)
    (args.results / f"question_{question}.json").write_text(
        json.dumps({"rows": rows, "provenance": record}, indent=1) + "\n"
    )
    print(text, flush=True)


if __name__ == "__main__":
  main()
