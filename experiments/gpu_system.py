"""The whole system on one accelerator: Qwen2.5-7B GRPO steps with the
zero-copy colocated rollout, against the plan.

One process, random weights (memory and time do not depend on their
values), the configuration of the 10 MB sync: LoGRA rank 8, sketch-direct
gradients, embeddings projected, bfloat16 base and coordinates, random
projectors refreshed every 2 steps, bfloat16 compute, block remat; or, with
``--rank 32 --step-bits 4``, the default rank with 4-bit steps (float32
coordinates), the other 10 MB configuration.

(a) **Memory.** The learner's state is made by one program from bfloat16
    matrices (no float32 copy of the model ever exists), then the colocated
    engine samples 64 prompts of 256 tokens to exactly 1024 tokens with the
    learner's own arrays (``policy_state.model_view``, as the default
    ``SharedEngine`` does; twice, the second timed), then the train step
    learns from that batch in micro-batches of one sequence. The device's
    running peak (``memory_stats``, since the process started) is read
    after each phase, beside the plan of these programs: XLA's memory
    analysis of the compiled train step and init, and of the sampling
    program lowered again as the planner lowers it (resident state plus the
    larger of the step's and the rollout's phase), and beside
    ``logra memory`` for the same command (:func:`plan_command`, run
    wherever the plan is wanted).
(b) **Log-prob agreement.** A fresh rollout with the trained weights, its
    sampler log-probs against the learner's recomputed ones
    (``models.token_logprobs`` on the same view) in bfloat16 (the matching
    dtype: share of tokens bitwise equal, max and mean gap) and with the
    learner computing in float32 (the mismatch a bfloat16 sampler brings);
    for the float32 learner, the loss's metrics without a correction and
    with ``loss.rollout_correction`` ``tis`` and ``mis`` at the default cap
    (``rl.algo.loss_terms``: the clipped fraction, importance weights);
    and a second rollout with sampler and learner both under
    ``DecoderConfig.batch_invariant`` in bfloat16 (bitwise on XLA:CPU;
    whether the accelerator's kernels keep it).
(c) **Sync.** A ``PolicySender`` / ``PolicyReceiver`` pair (the process
    engine's, on one device), made after the first train step: the full
    message, then one per later train step (a refresh every 2): bytes, the
    sending time (the message with its checksums, and its encoding, which
    copies the arrays to the host) and the receiving time (decoding and the
    receiver's apply); the receiver's state is verified by the checksums
    it carries and compared with the learner's at the end.

``--quick`` runs the same programs at tiny shapes on any device (the tests).
Writes ``gpu_system.json`` and ``gpu_system.md`` to
``experiments/results/gpu_system/`` (``--quick``: ``gpu_system-quick/``;
``--results``).

Usage:
  python experiments/gpu_system.py [--quick] [--results DIR] [--dump-step DIR]
  python experiments/gpu_system.py --report DIR   # the tables again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

import provenance

from logra_jax import configs
from logra_jax import memory
from logra_jax import models
from logra_jax import policy_state
from logra_jax import sync
from logra_jax.configs.loss import ROLLOUT_CORRECTIONS
from logra_jax.optim import factored
from logra_jax.rl import algo
from logra_jax.rl import learner

GIB = 2**30


class Setting(NamedTuple):
  """One measured configuration."""

  model: str
  rank: int
  seqs: int  # rollout sequences, trained on in micro-batches of one
  prompt: int
  new_tokens: int
  steps: int  # train steps, each followed by a sync message
  # optimizer.step_bits (float32 coordinates then), else bfloat16 ones.
  step_bits: Optional[int] = None


FULL = Setting("qwen2.5-7b", 8, 64, 256, 768, 4)
QUICK = Setting("tiny", 2, 4, 16, 48, 3)


def plan_command(setting: Setting) -> str:
  """``logra memory`` for the measured configuration at Qwen2.5-7B shapes."""
  coords = (
      f" --step-bits {setting.step_bits}"
      if setting.step_bits
      else " --coords-dtype bfloat16"
  )
  return (
      "logra memory --model qwen2.5-7b --mesh fsdp=1 --seq 1024 --micro-batch"
      f" 1 --optimizer logra --rank {setting.rank} --project-embeddings"
      f" --base-dtype bfloat16{coords} --rollout-seqs 64 --rollout-tokens 1024"
      " --device-memory-gib 24"
  )


def _decoder(setting: Setting, dtype: str) -> models.DecoderConfig:
  config = (
      models.DecoderConfig.tiny(vocab_size=512)
      if setting.model == "tiny"
      else memory.load_model_config(setting.model)
  )
  tokens = setting.prompt + setting.new_tokens
  return dataclasses.replace(
      config,
      dtype=dtype,
      param_dtype="float32",
      remat="block",
      max_position_embeddings=max(config.max_position_embeddings, tokens),
  )


def _optimizer(setting: Setting) -> configs.OptimizerConfig:
  return configs.OptimizerConfig(
      rank=setting.rank,
      learning_rate=1e-5,
      warmup_steps=0,
      kind="random",
      refresh_every=2,
      project_embeddings=True,
      base_dtype="bfloat16",
      coords_dtype="float32" if setting.step_bits else "bfloat16",
      step_bits=setting.step_bits,
  )


def _device_bytes(key: str) -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if stats is None else stats.get(key)


def _gib(value: int | None) -> float | None:
  return None if value is None else value / GIB


def _analysis(compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  return {
      "arguments": stats.argument_size_in_bytes,
      "outputs": stats.output_size_in_bytes - stats.alias_size_in_bytes,
      "temporaries": stats.temp_size_in_bytes,
  }


def _scalar(value) -> float | None:
  """A metric as a number: a ``(total, count)`` pair's mean (None without
  a count), or the value."""
  if isinstance(value, tuple):
    total, count = value
    return float(total / count) if float(count) else None
  return float(value)


def _timed(fn, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


def _init_state(config, opt_config, tx):
  """The learner's ``(weights, opt_state)`` from a model initialized with
  bfloat16 projected matrices (the leaves that stay dense in float32, as a
  run's), made in one program whose only outputs are the state."""
  model = models.init_model(
      dataclasses.replace(config, param_dtype="bfloat16"), rngs=0
  )
  _, params = models.split_model(model)
  layout = policy_state.abstract_weights(opt_config, tx, params)
  params = jax.tree.map(  # the leaves that stay dense: float32, as a run's
      lambda p, w: p if factored.is_factored(w) else p.astype(jnp.float32),
      params,
      layout,
  )
  return policy_state.init_train_state(opt_config, tx, params)


def _prompts(sampler, setting, seed):
  """``setting.seqs`` random prompts of ``setting.prompt`` tokens, padded
  as the sampler pads them."""
  prompts = np.random.RandomState(seed).randint(
      1, sampler.config.vocab_size, (setting.seqs, setting.prompt)
  )
  length = sampler.bucket_length(setting.prompt, setting.new_tokens)
  return models.pad_prompts(prompts.tolist(), length, sampler.pad_id)


def _sampling(setting) -> models.SamplingParams:
  """Temperature 1, exactly ``new_tokens`` per prompt."""
  return models.SamplingParams(
      max_new_tokens=setting.new_tokens, temperature=1.0, stop_ids=()
  )


def _rollout(sampler, weights, opt_state, setting, seed):
  """The zero-copy engine's sampling: the learner's arrays as the model
  consumes them, exactly ``new_tokens`` per prompt."""
  return sampler.sample_padded(
      policy_state.model_view(weights, opt_state),
      *_prompts(sampler, setting, seed),
      jax.random.key(seed),
      _sampling(setting),
  )


def _batch(out: models.SampleOutput) -> algo.RolloutBatch:
  rows = out.tokens.shape[0]
  return algo.RolloutBatch(
      prompt_tokens_BxP=out.prompt_ids,
      prompt_mask_BxP=out.prompt_mask.astype(jnp.int32),
      completion_tokens_BxT=out.tokens,
      completion_mask_BxT=out.mask.astype(jnp.int32),
      old_logp_BxT=out.logprobs,
      advantages_B=jnp.linspace(-1.0, 1.0, rows),
      num_generations=rows,
  )


def measure_memory(setting: Setting) -> tuple[dict, Any]:
  """(a): init, rollout and train steps with the device's peak after each;
  returns the figures and what (b) and (c) go on with."""
  config = _decoder(setting, "bfloat16")
  opt_config = _optimizer(setting)
  abstract = jax.eval_shape(lambda: models.init_model(config, rngs=0))
  graphdef, abstract_params = models.split_model(abstract)
  tx = policy_state.make_optimizer(opt_config, abstract_params)
  init = jax.jit(lambda: _init_state(config, opt_config, tx)).lower().compile()
  (weights, opt_state), init_s = _timed(init)
  resident = sum(x.nbytes for x in jax.tree.leaves((weights, opt_state)))
  in_use_after_init = _device_bytes("bytes_in_use")
  peaks = {"init": _device_bytes("peak_bytes_in_use")}
  sampler = models.Sampler(
      abstract, bucket_size=16, max_length=setting.prompt + setting.new_tokens
  )
  out, first_rollout_s = _timed(
      _rollout, sampler, weights, opt_state, setting, 0
  )
  peaks["rollout"] = _device_bytes("peak_bytes_in_use")
  _, rollout_s = _timed(_rollout, sampler, weights, opt_state, setting, 1)
  run = dataclasses.replace(
      configs.TrainConfig(), optimizer=opt_config, micro_batches=setting.seqs
  )
  batch = _batch(out)
  step = learner.make_train_step(graphdef, tx, run)
  start = time.perf_counter()
  compiled = step.lower(weights, opt_state, batch).compile()
  step_compile_s = time.perf_counter() - start
  state = (weights, opt_state)
  figures = {
      "init_s": init_s,
      "rollout_first_s": first_rollout_s,
      "rollout_s": rollout_s,
      "rollout_tokens_per_s": setting.seqs * setting.new_tokens / rollout_s,
      "step_compile_s": step_compile_s,
      "init_program": _analysis(init),
      "step_program": _analysis(compiled),
      "rollout_program": _rollout_analysis(sampler, state, setting),
      "resident_bytes": resident,
      "in_use_after_init": in_use_after_init,
  }
  return figures, (graphdef, tx, run, sampler, state, batch, compiled, peaks)


def _rollout_analysis(sampler, state, setting) -> dict[str, int]:
  """XLA's memory analysis of the sampling program just run (the very
  executable: no second compilation)."""
  lowered = sampler.lower_padded(
      policy_state.model_view(*state),
      *_prompts(sampler, setting, 0),
      jax.random.key(0),
      _sampling(setting),
  )
  return _analysis(lowered.compile())


def first_step(context) -> tuple[dict, Any]:
  """The first train step on the rollout's batch, then the device's peak:
  the system's (nothing else is on the device yet)."""
  graphdef, tx, run, sampler, state, batch, compiled, peaks = context
  start = time.perf_counter()
  weights, opt_state, metrics = compiled(*state, batch)
  jax.block_until_ready(metrics)
  seconds = time.perf_counter() - start
  peaks["step"] = _device_bytes("peak_bytes_in_use")
  figures = {
      "first_step_s": seconds,
      "first_step_metrics": {k: _scalar(v) for k, v in metrics.items()},
  }
  context = (graphdef, tx, run, sampler, (weights, opt_state), batch)
  return figures, context + (compiled, peaks)


def train_and_sync(setting: Setting, context) -> tuple[dict, Any]:
  """(c): a receiver on the same device, the full message it starts from,
  then the other train steps, each followed by a message."""
  graphdef, tx, run, sampler, state, batch, compiled, peaks = context
  weights, opt_state = state
  sender = sync.PolicySender(weights, opt_state, seed=run.seed)
  template, projectors = policy_state.abstract_receiver(
      run.optimizer,
      models.split_model(
          jax.eval_shape(lambda: models.init_model(sampler.config, rngs=0))
      )[1],
  )
  receiver = sync.PolicyReceiver(template, seed=run.seed, projectors=projectors)
  messages = [_sync_once(sender, receiver, weights, opt_state)]
  step_s = []
  for _ in range(setting.steps - 1):
    start = time.perf_counter()
    weights, opt_state, metrics = compiled(weights, opt_state, batch)
    jax.block_until_ready(metrics)
    step_s.append(time.perf_counter() - start)
    messages.append(_sync_once(sender, receiver, weights, opt_state))
  peaks["sync"] = _device_bytes("peak_bytes_in_use")
  figures = {
      "step_s": step_s,
      "messages": messages,
      "receiver_equal": all(
          bool(jnp.array_equal(a, b))
          for a, b in zip(
              jax.tree.leaves(receiver.state),
              jax.tree.leaves(policy_state.synced_state(weights, opt_state)),
          )
      ),
  }
  return figures, (graphdef, sampler, weights, opt_state)


def _sync_once(sender, receiver, weights, opt_state) -> dict:
  start = time.perf_counter()
  message = sender.message(weights, opt_state)
  data = sync.encode(message)  # the arrays' copy to the host happens here
  encoded = time.perf_counter()
  decoded = sync.decode(data)
  receiver.apply(decoded)
  jax.block_until_ready(jax.tree.leaves(receiver.state))
  applied = time.perf_counter()
  return {
      "full": message.full,
      "merge": message.merge_step >= 0,
      "bytes": len(data),
      "send_s": encoded - start,
      "receive_s": applied - encoded,
  }


def _gaps(sampler_logp, learner_logp, mask) -> dict:
  valid = np.asarray(mask) > 0
  gap = np.abs(np.asarray(learner_logp) - np.asarray(sampler_logp))[valid]
  return {
      "tokens": int(valid.sum()),
      "bitwise_equal_share": float((gap == 0).mean()),
      "max_gap": float(gap.max()),
      "mean_gap": float(gap.mean()),
  }


def logprob_agreement(setting: Setting, context) -> dict:
  """(b): a fresh rollout with the trained weights against the learner's
  recomputed log-probs, bfloat16 and float32."""
  graphdef, sampler, weights, opt_state = context
  out = _rollout(sampler, weights, opt_state, setting, 2)
  view = policy_state.model_view(weights, opt_state)
  args = (out.prompt_ids, out.prompt_mask, out.tokens, out.mask)
  result = {}
  for dtype in ("bfloat16", "float32"):
    dtype_graphdef, _ = models.split_model(
        jax.eval_shape(
            lambda: models.init_model(_decoder(setting, dtype), rngs=0)
        )
    )
    learner_logp = jax.jit(
        lambda v, *a: models.token_logprobs(dtype_graphdef, v, *a)
    )(view, *args)
    result[dtype] = _gaps(out.logprobs, learner_logp, out.mask)
  result["float32_loss"] = _corrections(
      learner_logp, out.logprobs, out.mask.astype(jnp.float32)
  )
  result["bfloat16_batch_invariant"] = _invariant_gaps(setting, view)
  return result


def _invariant_gaps(setting: Setting, view) -> dict:
  """Sampler and learner both under ``DecoderConfig.batch_invariant``,
  bfloat16: whether the accelerator's kernels are row-invariant too."""
  config = _decoder(setting, "bfloat16").replace(batch_invariant=True)
  abstract = jax.eval_shape(lambda: models.init_model(config, rngs=0))
  graphdef, _ = models.split_model(abstract)
  sampler = models.Sampler(
      abstract, bucket_size=16, max_length=setting.prompt + setting.new_tokens
  )
  out = sampler.sample_padded(
      view,
      *_prompts(sampler, setting, 2),
      jax.random.key(2),
      _sampling(setting),
  )
  args = (out.prompt_ids, out.prompt_mask, out.tokens, out.mask)
  learner_logp = jax.jit(lambda v, *a: models.token_logprobs(graphdef, v, *a))(
      view, *args
  )
  return _gaps(out.logprobs, learner_logp, out.mask)


def _corrections(learner_logp, sampler_logp, mask) -> dict:
  """The loss's metrics of one on-policy update whose learner computes in
  float32 and whose sampler in bfloat16, without and with a correction."""
  advantages = jnp.linspace(-1.0, 1.0, mask.shape[0])
  result = {}
  for correction in ROLLOUT_CORRECTIONS:
    config = configs.LossConfig(rollout_correction=correction)
    _, _, metrics = jax.jit(
        lambda lp, sp, m, a: algo.loss_terms(
            lp, m, a, sp, config=config, proximal_logp_BxT=lp
        )
    )(learner_logp, sampler_logp, mask, advantages)
    result[correction] = {k: _scalar(v) for k, v in metrics.items()}
  return result


def _plan_row(figures: dict, peaks: dict) -> dict:
  """The executed programs' own plan: the resident state plus the larger
  of the step's phase (its arguments beyond the state, temporaries and
  outputs) and the rollout's (temporaries and outputs)."""
  resident = figures["resident_bytes"]
  step, rollout = figures["step_program"], figures["rollout_program"]
  step_phase = (
      step["arguments"] - resident + step["temporaries"] + step["outputs"]
  )
  rollout_phase = rollout["temporaries"] + rollout["outputs"]
  return {
      "resident_gib": _gib(resident),
      "step_phase_gib": _gib(step_phase),
      "rollout_phase_gib": _gib(rollout_phase),
      "planned_gib": _gib(resident + max(step_phase, rollout_phase)),
      "peak_gib": {k: _gib(v) for k, v in peaks.items()},
  }


def run(setting: Setting, save) -> dict:
  """(a), (b) and (c) in one process, in that order (the diagnostics of
  (b) and the receiver of (c) come after the system's peak is read);
  ``save(figures)`` after each phase, so that a failure keeps what was
  measured before it (then raised)."""
  figures = {"device": jax.devices()[0].device_kind}
  measured, context = measure_memory(setting)
  figures.update(measured)
  peaks = context[-1]
  figures["memory"] = _plan_row(figures, peaks)  # kept if the step fails
  save(figures)
  stepped, context = first_step(context)
  figures.update(stepped)
  figures["memory"] = _plan_row(figures, peaks)
  save(figures)
  trained, context = train_and_sync(setting, context)
  figures.update(trained)
  figures["memory"] = _plan_row(figures, peaks)
  save(figures)
  figures["logprobs"] = logprob_agreement(setting, context)
  save(figures)
  return figures


def _fmt(value, spec: str = ".2f") -> str:
  return "-" if value is None else format(value, spec)


def _memory_lines(setting: Setting, record: dict) -> list[str]:
  mem, peak = record["memory"], record["memory"]["peak_gib"]
  cells = (
      mem["resident_gib"],
      mem["step_phase_gib"],
      mem["rollout_phase_gib"],
      mem["planned_gib"],
      peak.get("init"),
      peak.get("rollout"),
      peak.get("step"),
      peak.get("sync"),
  )
  step_metrics = record["first_step_metrics"]
  steps = [record["first_step_s"]] + record.get("step_s", [])
  return [
      "| GiB | resident state | step phase | rollout phase | planned "
      "(these programs) | running peak after init | after rollouts | "
      "after step | after sync (receiver's copy too) |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
      "| memory | " + " | ".join(_fmt(v) for v in cells) + " |",
      "",
      f"Plan for the same shapes on any machine: `{plan_command(setting)}`.",
      "",
      f"Rollout: {record['rollout_tokens_per_s']:.0f} tokens/s "
      f"({record['rollout_s']:.2f} s warm, {record['rollout_first_s']:.1f} s"
      f" with compile); train step {np.median(steps):.2f} s (first "
      f"{steps[0]:.2f} s; compile {record['step_compile_s']:.1f} s).",
      "",
      "The first train step's own metrics (its bfloat16 forward against the"
      " sampler's log-probs): gap max "
      + _fmt(step_metrics.get("rollout/logprob_gap_max"), ".3g")
      + ", mean "
      + _fmt(step_metrics.get("rollout/logprob_gap_mean"), ".3g")
      + "; importance weight mean "
      + _fmt(step_metrics.get("rollout/is_weight_mean"), ".6f")
      + ".",
  ]


def _logprob_lines(record: dict) -> list[str]:
  lines = [
      "| learner dtype | tokens | bitwise equal | max gap | mean gap |",
      "|---|---:|---:|---:|---:|",
  ]
  rows = {
      "bfloat16": "bfloat16",
      "float32": "float32",
      "bfloat16_batch_invariant": "bfloat16, both batch-invariant",
  }
  for key, label in rows.items():
    if key not in record["logprobs"]:  # a run before the row existed
      continue
    row = record["logprobs"][key]
    lines.append(
        f"| {label} | {row['tokens']} | {row['bitwise_equal_share']:.1%} | "
        f"{row['max_gap']:.3g} | {row['mean_gap']:.3g} |"
    )
  lines += [
      "",
      "| float32 learner, bfloat16 sampler | clipped fraction | IS weight "
      "mean | over the cap |",
      "|---|---:|---:|---:|",
  ]
  for name, metrics in record["logprobs"]["float32_loss"].items():
    lines.append(
        f"| {name} | {_fmt(metrics.get('clip_fraction'), '.2e')} | "
        f"{_fmt(metrics.get('rollout/is_weight_mean'), '.6f')} | "
        f"{_fmt(metrics.get('rollout/is_truncated_fraction'), '.2e')} |"
    )
  return lines


def _sync_lines(record: dict) -> list[str]:
  lines = [
      "| message | full | refresh | bytes | send, s | receive, s |",
      "|---|---|---|---:|---:|---:|",
  ]
  for i, m in enumerate(record["messages"]):
    lines.append(
        f"| {i} | {m['full']} | {m['merge']} | {m['bytes']:,} | "
        f"{m['send_s']:.3f} | {m['receive_s']:.3f} |"
    )
  steps = 1 + len(record["step_s"])
  return lines + [
      "",
      f"Receiver bit-identical to the learner after {steps} steps: "
      f"{record['receiver_equal']}.",
  ]


def report(record: dict) -> str:
  """The markdown tables of a run's record (``gpu_system.json``); a part
  that a stopped run did not reach is said to be missing."""
  setting = Setting(**record["setting"])
  tokens = setting.prompt + setting.new_tokens
  lines = [
      f"{setting.model}, {record['device']}: LoGRA rank {setting.rank}"
      + (f", {setting.step_bits}-bit steps" if setting.step_bits else "")
      + ", "
      f"rollout {setting.seqs} x {tokens} tokens (zero-copy), train "
      f"micro-batch 1 x {tokens}.",
  ]
  parts = (
      ("memory", lambda: _memory_lines(setting, record)),
      ("messages", lambda: _sync_lines(record)),
      ("logprobs", lambda: _logprob_lines(record)),
  )
  for key, lines_of in parts:
    lines.append("")
    lines += lines_of() if key in record else [f"({key}: not reached)"]
  return "\n".join(lines) + f"\n\n{provenance.footer(record['provenance'])}\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--results", type=pathlib.Path)
  parser.add_argument(
      "--report",
      type=pathlib.Path,
      metavar="DIR",
      help="only write DIR/gpu_system.md again from DIR/gpu_system.json",
  )
  parser.add_argument(
      "--rank",
      type=int,
      help=f"LoGRA's rank (default {FULL.rank}; --quick {QUICK.rank})",
  )
  parser.add_argument(
      "--step-bits",
      type=int,
      choices=[4, 8],
      help="quantized steps (optimizer.step_bits) with float32 coordinates; "
      "default: bfloat16 coordinates",
  )
  parser.add_argument(
      "--dump-step",
      type=pathlib.Path,
      metavar="DIR",
      help="also write XLA's dumps of the train step (its optimized HLO and "
      "buffer assignment: which buffers its temporaries are) to DIR",
  )
  args = parser.parse_args()
  if args.dump_step:  # read when the backend starts, at the first program
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump_step}"
        " --xla_dump_hlo_module_re=.*train_step.*"
    )
  if args.report:
    if not (args.report / "gpu_system.json").is_file():
      parser.error(f"--report: {args.report} holds no gpu_system.json")
    record = json.loads((args.report / "gpu_system.json").read_text())
    (args.report / "gpu_system.md").write_text(report(record))
    return
  if args.rank is not None and args.rank < 1:
    parser.error(f"--rank must be >= 1, got {args.rank}")
  setting = (QUICK if args.quick else FULL)._replace(step_bits=args.step_bits)
  if args.rank is not None:
    setting = setting._replace(rank=args.rank)
  results_dir = args.results or provenance.RESULTS / (
      "gpu_system-quick" if args.quick else "gpu_system"
  )
  command = " ".join(["python experiments/gpu_system.py"] + sys.argv[1:])
  results_dir.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()

  origin = provenance.collect(command, "not computed")

  def save(figures: dict) -> None:
    record = {"provenance": origin, "setting": setting._asdict(), **figures}
    record["seconds"] = time.perf_counter() - start
    (results_dir / "gpu_system.json").write_text(
        json.dumps(record, indent=1) + "\n"
    )

  run(setting, save)
  table = report(json.loads((results_dir / "gpu_system.json").read_text()))
  (results_dir / "gpu_system.md").write_text(table)
  print(table)


if __name__ == "__main__":
  main()
