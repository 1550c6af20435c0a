"""Does lossless compression of sync messages pay? Measured on the messages
of real RL steps.

Follows a parity setting's LoGRA arms through their learning-rate warm-up
and then ``--steps`` steps each, in the study's configuration (its
starting policy, task, batch and the rate its sweep chose for the arm;
``--learning-rate`` otherwise; the prompts drawn at random per step, not in
the trainer's order), and builds the message each step sends
(:class:`logra_jax.sync.PolicySender`, as the trainer's process engine
receives it). The warm-up's messages are sent but not measured: their steps
are scaled down (the first is zero), so they would flatter the XOR scheme.
Each array of each measured step message is compressed by every scheme, the
arrays of one kind as one stream, then decompressed and compared bit for
bit:

  zlib            ``zlib.compress`` at level 6 of the arrays' bytes;
  shuffle+zlib    the bytes regrouped by their position in a value (all
                  first bytes, then all second bytes, ...: exponents and
                  high mantissa bits together), then zlib;
  xor+shuffle+zlib
                  the bitwise XOR with the same array in the previous step's
                  message, shuffled, then zlib: values that changed little
                  share their sign, exponent and high mantissa bits, so the
                  XOR is mostly zero bytes. Exact: the receiver XORs it
                  back onto the array it holds, before it applies a window
                  merge, where that is the last message's (coordinates,
                  scales and dense leaves, unless it merges ahead); 4-bit
                  step codes are deltas, so their last message is kept
                  (small);
  lzma            ``lzma.compress`` at preset 1 of the shuffled XOR.

Reported per arm and kind of array (coordinates ``A``, scales ``c``, dense
leaves, 4-bit step codes): raw bytes per step, each scheme's ratio (raw /
compressed) and its compression and decompression throughput on this CPU
(one thread, the fastest of :data:`TIMINGS` repetitions), and the spread of
a whole step message's ratio over the measured steps. The measured steps
hold a window merge only where the arm refreshes within them (every 10
steps in logra-small-sync; every 50 elsewhere, so none). From those: the
bytes of a step at Qwen2.5-7B shapes (:func:`sync_bytes.message_bytes`)
compressed at the tiny run's ratio per kind (an assumption: at 7B the
input embedding's unseen rows never change, so its XOR would compress
further; the LM head changes every row every step), and the link
bandwidth below which compressing pays, for the tiny message and for the
7B one (whose mix of kinds differs): the scheme's saved bytes over its
compression and decompression seconds.

``--quick``: the smoke policy for 3 steps (outputs well formed only).

Writes ``sync_compression.md`` and ``.json`` to
``experiments/results/sync_compression/`` (``--results``).

Run: python experiments/sync_compression.py [--setting tiny] [--steps 20]
     [--arms logra logra-projected logra-small-sync logra-10mb]
"""

from __future__ import annotations

import collections
import json
import lzma
import math
import time
import zlib

import numpy as np

import parity
import parity_design
import provenance
import study
import sync_bytes
from logra_jax import policy_state
from logra_jax import sync
from logra_jax.sync import messages
from logra_jax.rl import learner

KINDS = ("coords", "scale", "dense", "codes", "projector")
# Each compression and decompression is timed this many times and the
# fastest kept: the least disturbed by other work on the machine.
TIMINGS = 3
DEFAULT_ARMS = ["logra", "logra-projected", "logra-small-sync", "logra-10mb"]


def kind_of(name: str) -> str:
  """The kind of a step message's array, from its name
  (:func:`logra_jax.sync.named_arrays`' parts, the step codes' suffixes)."""
  if name.startswith("projector:"):
    return "projector"
  for suffix, kind in (
      (".coords", "coords"),
      (".scale", "scale"),
      (messages.CODES, "codes"),
      (messages.EXPONENTS, "codes"),
  ):
    if name.endswith(suffix):
      return kind
  return "dense"


def shuffled(data: np.ndarray) -> bytes:
  """The array's bytes grouped by their position in a value."""
  raw = np.ascontiguousarray(data).view(np.uint8)
  width = data.dtype.itemsize
  return raw.reshape(-1, width).T.tobytes() if width > 1 else raw.tobytes()


def unshuffled(data: bytes, like: np.ndarray) -> np.ndarray:
  """The inverse of :func:`shuffled` for an array shaped as ``like``."""
  width = like.dtype.itemsize
  raw = np.frombuffer(data, np.uint8)
  if width > 1:
    raw = raw.reshape(width, -1).T
  return np.ascontiguousarray(raw).view(like.dtype).reshape(like.shape)


def _bits(x: np.ndarray) -> np.ndarray:
  """The array's bits as unsigned integers of its width."""
  return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")


# Each scheme: how an array becomes bytes (given its previous value's bits)
# and the codec of a kind's bytes, all its arrays in one stream.
_XOR = "xor"
SCHEME_PARTS = {
    "zlib": ("raw", "zlib"),
    "shuffle+zlib": ("shuffle", "zlib"),
    "xor+shuffle+zlib": (_XOR, "zlib"),
    "lzma": (_XOR, "lzma"),
}
SCHEMES = tuple(SCHEME_PARTS)
CODECS = {
    "zlib": (lambda b: zlib.compress(b, 6), zlib.decompress),
    "lzma": (lambda b: lzma.compress(b, preset=1), lzma.decompress),
}


def to_bytes(form: str, x: np.ndarray, old: np.ndarray) -> bytes:
  """``x`` as bytes of ``form``: raw, shuffled, or its XOR with ``old``
  shuffled."""
  if form == "raw":
    return np.ascontiguousarray(x).tobytes()
  return shuffled(_bits(x) ^ _bits(old) if form == _XOR else x)


def from_bytes(form: str, data: bytes, like: np.ndarray, old: np.ndarray):
  """The inverse of :func:`to_bytes`."""
  if form == "raw":
    return np.frombuffer(data, like.dtype).reshape(like.shape)
  if form == _XOR:
    restored = unshuffled(data, _bits(like)) ^ _bits(old)
    return restored.view(like.dtype).reshape(like.shape)
  return unshuffled(data, like)


class Tally:
  """Raw and compressed bytes and seconds per (kind, scheme), over the step
  messages measured, and each message's raw and compressed bytes per scheme
  (the refresh's projectors aside)."""

  def __init__(self):
    self.raw = collections.Counter()
    self.packed = collections.Counter()
    self.seconds = collections.Counter()  # compression
    self.back_seconds = collections.Counter()  # decompression
    self.steps: list[dict[str, tuple[int, int]]] = []

  def add(self, arrays: dict[str, np.ndarray], previous: dict) -> None:
    """One step message's arrays (``previous``: the last message's), each
    kind's arrays compressed as one stream by every scheme and restored."""
    by_kind = collections.defaultdict(list)
    for name, x in arrays.items():
      old = previous.get(name)
      if old is None or old.shape != x.shape or old.dtype != x.dtype:
        old = np.zeros_like(x)  # XOR with nothing: the array itself
      by_kind[kind_of(name)].append((name, x, old))
    step = collections.Counter()
    for kind, items in by_kind.items():
      raw = sum(x.nbytes for _, x, _ in items)
      self.raw[kind] += raw
      for scheme, (form, codec) in SCHEME_PARTS.items():
        packed = self._compress(kind, scheme, form, codec, items)
        if kind != "projector":
          step[scheme, "raw"] += raw
          step[scheme, "packed"] += packed
    self.steps.append({s: (step[s, "raw"], step[s, "packed"]) for s in SCHEMES})

  def _compress(self, kind, scheme, form, codec, items) -> int:
    """One kind's arrays as one stream of ``scheme``: compressed, restored
    (timed apart), then checked bit for bit; the compressed bytes."""
    compress, decompress = CODECS[codec]
    there, back = math.inf, math.inf
    for _ in range(TIMINGS):
      start = time.perf_counter()
      data = compress(b"".join(to_bytes(form, x, o) for _, x, o in items))
      middle = time.perf_counter()
      stream, at, backs = decompress(data), 0, []
      for _, x, old in items:
        backs.append(from_bytes(form, stream[at : at + x.nbytes], x, old))
        at += x.nbytes
      there = min(there, middle - start)
      back = min(back, time.perf_counter() - middle)
    self.seconds[kind, scheme] += there
    self.back_seconds[kind, scheme] += back
    self.packed[kind, scheme] += len(data)
    for (name, x, _), back in zip(items, backs):
      same = back.shape == x.shape and back.dtype == x.dtype
      if not (same and np.array_equal(_bits(back), _bits(x))):
        raise AssertionError(f"{scheme} did not restore {name} exactly")
    return len(data)

  def summary(self) -> dict[str, dict]:
    """Per kind present: raw bytes per message and, per scheme, the ratio
    raw / compressed and the throughputs in MB/s of raw bytes."""
    out = {}
    for kind in KINDS:
      raw = self.raw[kind]
      if not raw:
        continue
      out[kind] = {"raw_bytes_per_step": raw / len(self.steps)}
      for scheme in SCHEMES:
        packed = self.packed[kind, scheme]
        there, back = (
            self.seconds[kind, scheme],
            self.back_seconds[kind, scheme],
        )
        out[kind][scheme] = {
            "ratio": raw / packed,
            "compress_mb_s": raw / 1e6 / there if there else float("nan"),
            "decompress_mb_s": raw / 1e6 / back if back else float("nan"),
        }
    return out

  def spread(self) -> dict[str, list[float]]:
    """Per scheme: the smallest, median and largest ratio of a whole step
    message (raw / compressed) over the measured steps."""
    return {
        s: [
            float(q)
            for q in np.quantile(
                [raw / packed for raw, packed in (m[s] for m in self.steps)],
                [0.0, 0.5, 1.0],
            )
        ]
        for s in SCHEMES
    }


def follow(args, config) -> Tally:
  """The arm's run through its warm-up (``optimizer.warmup_steps``) and
  ``--steps`` steps more, the step messages after the warm-up tallied (the
  first against the warm-up's last)."""
  policy, sample = study.sampler(config)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  weights, opt_state = policy_state.init_train_state(
      config.optimizer, tx, policy.params, seed=config.seed
  )
  train_step = learner.make_train_step(policy.graphdef, tx, config)
  sender = sync.PolicySender(
      weights,
      opt_state,
      seed=config.seed,
      frozen=policy_state.frozen_keys(config.optimizer),
  )
  full = sender.message(weights, opt_state, full=True)
  tally = Tally()
  previous = {n: np.asarray(x) for n, x in full.arrays.items()}
  warmup = config.optimizer.warmup_steps
  for step in range(warmup + args.steps):
    view = policy_state.model_view(weights, opt_state)
    batch, metrics = sample(view, step)
    weights, opt_state, _ = train_step(weights, opt_state, batch)
    message = sender.message(weights, opt_state)
    arrays = {n: np.asarray(x) for n, x in message.arrays.items()}
    if step >= warmup and not message.full:
      tally.add(arrays, previous)
    previous = arrays
    print(
        f"step {step}: reward {metrics['reward/total']:.3f}, message "
        f"{sum(x.nbytes for x in arrays.values()) / 1e6:.3f} MB",
        flush=True,
    )
  return tally


def totals(summary: dict[str, dict], scheme: str) -> dict[str, float]:
  """A scheme over every kind of a step message but a refresh's projectors:
  raw and compressed bytes per step, seconds per step to compress and
  decompress, and the link bandwidth (bytes/s) below which compressing
  pays (0: it never does)."""
  kinds = {k: v["raw_bytes_per_step"] for k, v in summary.items()}
  return _totals(summary, scheme, kinds)


def _totals(summary, scheme: str, kind_bytes: dict[str, float]) -> dict:
  """:func:`totals` of a message of ``kind_bytes`` (raw bytes per kind),
  each kind at the ratio and throughputs ``summary`` measured for it."""
  kind_bytes = {k: b for k, b in kind_bytes.items() if k != "projector" and b}
  raw = sum(kind_bytes.values())
  packed = sum(b / summary[k][scheme]["ratio"] for k, b in kind_bytes.items())
  seconds = sum(
      b / 1e6 / summary[k][scheme][rate]
      for k, b in kind_bytes.items()
      for rate in ("compress_mb_s", "decompress_mb_s")
  )
  return {
      "raw": raw,
      "packed": packed,
      "seconds": seconds,
      "break_even_bytes_s": max(0.0, (raw - packed) / seconds),
  }


def at_7b(config, summary: dict[str, dict], scheme: str) -> dict[str, float]:
  """:func:`totals` of a step message at Qwen2.5-7B shapes in the arm's
  settings (the refresh's projectors aside), each kind at the ratio and
  throughputs measured here."""
  opt = config.optimizer
  parts = sync_bytes.message_bytes(
      "qwen2.5-7b",
      opt.rank,
      sync_bytes.embeddings_of(opt),
      coords_dtype=opt.coords_dtype,
      kind=opt.kind,
      step_bits=opt.step_bits,
  )
  coords = "codes" if opt.step_bits else "coords"
  kinds = {sync.COORDS: coords, sync.SCALE: "scale", sync.DENSE: "dense"}
  return _totals(summary, scheme, {ours: parts[k] for k, ours in kinds.items()})


def _bandwidth(bytes_s: float) -> str:
  """A break-even bandwidth in MB/s ("never" where compressing never
  pays)."""
  return f"{bytes_s / 1e6:,.1f}" if bytes_s > 0 else "never"


def report(args, results: dict, record: dict) -> str:
  """The markdown tables: per arm and kind, and per arm in total with its
  Qwen2.5-7B projection."""
  lines = [
      f"Step messages of {args.steps} steps per arm on `{args.setting}`, "
      "after its learning-rate warm-up (whose scaled-down steps, the first "
      "of them zero, would flatter the XOR); ratio = raw / compressed, every "
      "scheme restoring each array bit for bit; throughputs in MB/s of raw "
      "bytes, one thread of this CPU.",
      "",
      "| arm | kind | raw KB/step | "
      + " | ".join(f"{s} ratio (MB/s in, out)" for s in SCHEMES)
      + " |",
      "|---|---|---:|" + "---:|" * len(SCHEMES),
  ]
  for arm, result in results.items():
    for kind, row in result["summary"].items():
      cells = [
          f"{row[s]['ratio']:.2f} ({row[s]['compress_mb_s']:.0f}, "
          f"{row[s]['decompress_mb_s']:.0f})"
          for s in SCHEMES
      ]
      lines.append(
          f"| {arm} | {kind} | {row['raw_bytes_per_step'] / 1e3:.1f} | "
          + " | ".join(cells)
          + " |"
      )
  lines += [
      "",
      "Per step in total (ratio of the measured steps' bytes; the smallest, "
      "median and largest ratio of one step's message), and at Qwen2.5-7B "
      "shapes (each kind's bytes at the ratio and throughputs measured "
      "here, so the ratio of the 7B step follows its own mix of kinds; the "
      "refresh's projectors aside): compressing pays on a link slower than "
      "the break-even bandwidth (saved bytes over the seconds to compress "
      "and decompress).",
      "",
      "| arm | learning rate | scheme | ratio | per step (min, median, max) "
      "| break-even link, MB/s | 7B step raw, MB | 7B step compressed, MB "
      "| 7B ratio | 7B break-even link, MB/s | 7B seconds to compress and "
      "decompress |",
      "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for arm, result in results.items():
    for scheme in SCHEMES:
      total, big = result["totals"][scheme], result["qwen2.5-7b"][scheme]
      low, median, high = result["spread"][scheme]
      lines.append(
          f"| {arm} | {result['learning_rate']:.3g} | {scheme} | "
          f"{total['raw'] / total['packed']:.2f} | "
          f"{low:.2f}, {median:.2f}, {high:.2f} | "
          f"{_bandwidth(total['break_even_bytes_s'])} | "
          f"{big['raw'] / 1e6:,.1f} | {big['packed'] / 1e6:,.1f} | "
          f"{big['raw'] / big['packed']:.2f} | "
          f"{_bandwidth(big['break_even_bytes_s'])} | {big['seconds']:,.1f} |"
      )
  return "\n".join(lines + ["", provenance.footer(record)]) + "\n"


def parse_args():
  """The flags, checked before anything runs (exit 2)."""
  parser = study.parser(__doc__.splitlines()[0], "sync_compression", runs=False)
  parser.add_argument(
      "--setting",
      default="tiny",
      help=f"a parity setting of {sorted(parity_design.SETTINGS)}",
  )
  parser.add_argument(
      "--arms",
      nargs="+",
      default=DEFAULT_ARMS,
      help=f"LoGRA arms of the parity study (default {DEFAULT_ARMS})",
  )
  parser.add_argument(
      "--steps", type=int, help="steps followed per arm (20; 3 --quick)"
  )
  parser.add_argument(
      "--learning-rate",
      type=float,
      help="every arm's rate (default: the rate the study chose for it)",
  )
  args = study.parse(parser)
  study.check_names(parser, "setting", [args.setting], parity_design.SETTINGS)
  logra_arms = [a for a in parity_design.ARMS if a.startswith("logra")]
  study.check_names(parser, "arms", args.arms, logra_arms)
  if args.steps is None:
    args.steps = 3 if args.quick else 20
  if args.steps < 2:
    study.fail(
        f"--steps must be >= 2 (the spread of a step's ratio needs two), "
        f"got {args.steps}"
    )
  study.check_positive("learning-rate", args.learning_rate)
  return args


def arm_rate(args, shared, arm: str) -> float:
  """``--learning-rate``, else the rate the parity study chose for ``arm``
  (with ``--quick``, where no study ran, its grid's smallest); a sweep
  still incomplete exits (status 2)."""
  rate = args.learning_rate or parity.tuned_rate(shared, args.setting, arm)
  if rate is None and args.quick:
    rate = parity_design.grid(
        shared, arm, parity_design.setting_of(args, args.setting)
    )[0]
  if rate is None:
    study.fail(
        f"--arms {arm}: the parity study's sweep of {arm} on "
        f"{args.setting} is not complete; give --learning-rate"
    )
  return rate


def arm_config(args, shared, arm: str, rate: float):
  """The arm's run config, as the study runs it (a bad ``--set`` exits,
  status 2); :func:`follow` counts the steps itself."""
  return study.run_config(
      args,
      parity.run_overrides(shared, args.setting, arm, rate, 0, False),
      parity_design.setting_of(args, args.setting).preset,
  )


def measure(args, arm: str, rate: float, config) -> dict:
  """One arm followed and summed up: its kinds, totals per scheme, the
  spread over steps and the Qwen2.5-7B projection."""
  print(f"{arm} at {rate:g}", flush=True)
  tally = follow(args, config)
  summary = tally.summary()
  return {
      "learning_rate": rate,
      "messages": len(tally.steps),
      "summary": summary,
      "totals": {s: totals(summary, s) for s in SCHEMES},
      "spread": tally.spread(),
      "qwen2.5-7b": {s: at_7b(config, summary, s) for s in SCHEMES},
  }


def main() -> None:
  args = parse_args()
  shared = parity.helper_args(args)
  planned = {}
  for arm in args.arms:
    rate = arm_rate(args, shared, arm)
    planned[arm] = rate, arm_config(args, shared, arm, rate)
  results_dir = study.results_folder(args, "sync_compression")
  record = study.provenance_record(args)
  parity.prepare(shared, [args.setting], record)
  results = {arm: measure(args, arm, *planned[arm]) for arm in args.arms}
  table = report(args, results, record)
  (results_dir / "sync_compression.json").write_text(
      json.dumps({"provenance": record, "arms": results}, indent=1) + "\n"
  )
  (results_dir / "sync_compression.md").write_text(table)
  study.write_provenance(record, results_dir)
  print(table, flush=True)


if __name__ == "__main__":
  main()
