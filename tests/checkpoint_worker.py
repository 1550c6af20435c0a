"""`logra ...` in a child process, with faults to inject, for the tests.

  python tests/checkpoint_worker.py [--block-save STEP] [--step-delay S] -- ARGS

``--block-save STEP`` stops the save of checkpoint ``STEP`` just before Orbax
renames its temporary folder into place (every array and the metadata are
written by then), prints ``BLOCKED IN SAVE STEP`` and waits to be killed: the
latest moment a crash can hit a save. ``--step-delay S`` prints ``ROLLOUT`` and
sleeps ``S`` seconds at the start of every rollout, so that a signal lands in
the middle of a run. ``ARGS`` are
passed to ``logra``; the exit status is the command's.
"""

import argparse
import sys
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")

from orbax.checkpoint._src.path import atomicity  # noqa: E402

from logra_jax import cli  # noqa: E402
from logra_jax.rl import scoring  # noqa: E402


def block_save(step: int) -> None:
  original = atomicity.AtomicRenameTemporaryPath.finalize

  async def finalize(self, *args, **kwargs):
    if self.get_final().name == str(step):
      print(f"BLOCKED IN SAVE {step}", flush=True)
      time.sleep(600)
    return await original(self, *args, **kwargs)

  atomicity.AtomicRenameTemporaryPath.finalize = finalize


def delay_steps(seconds: float) -> None:
  original = scoring.rollout_with

  def rollout_with(*args, **kwargs):
    print("ROLLOUT", flush=True)
    time.sleep(seconds)
    return original(*args, **kwargs)

  scoring.rollout_with = rollout_with


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--block-save", type=int)
  parser.add_argument("--step-delay", type=float, default=0.0)
  parser.add_argument("args", nargs=argparse.REMAINDER)
  args = parser.parse_args()
  if args.block_save is not None:
    block_save(args.block_save)
  if args.step_delay:
    delay_steps(args.step_delay)
  command = args.args[1:] if args.args[:1] == ["--"] else args.args
  return cli.main(command)


if __name__ == "__main__":
  sys.exit(main())
