"""Where a study's numbers come from: the code (commit, dirty tree, a
numerics fingerprint), the date, the machine, the package versions and
the exact command.

The numerics fingerprint is a hash of short deterministic runs' metrics:
``logra train --preset smoke`` (3 steps), once as it is and once in the
configuration small sync messages need (:data:`FINGERPRINT_RUNS`), their
``metrics.jsonl`` without the ``time/`` and ``compile/`` keys (which vary
from run to run), hashed with SHA-256. Two trees whose smoke runs agree
bit for bit share it; a change that moves any loss, reward or KL of either
configuration changes it. It is computed once per invocation and cached
in a cache folder by code version (:func:`code_version`).

On CPU the smoke run's code is generated for at most AVX2
(``--xla_cpu_max_isa=AVX2``): XLA:CPU vectorizes for the host's instruction
set, and below AVX2 the same tree's metrics move in their last bits
(measured on one Intel host: AVX and SSE4.2 give other hashes, AVX2 and
AVX-512 the same one). The pin does not make the fingerprint the same on
every host: XLA:CPU's kernels also choose their blocking by the CPU model,
and an AMD EPYC (AVX2) host gives commit 34b4de8 the fingerprint
c38da4c37512f332 where the Intel AVX-512 host gave 8018620529c3b7bc. So the
fingerprint names the code on a host, and the ledger
(``experiments/results/fingerprints.json``, :func:`note_fingerprint`)
records which fingerprints one package tree (``logra_jax/`` at a commit)
had on which hosts: :func:`same_numerics` reads from it which fingerprints
of one definition name the same code, so that a study's rows made on
several hosts are pooled only when the code behind them is one (a study's
runs are not pinned: each row records its host, :func:`machine`).

Example:
  >>> record = collect("python experiments/parity.py --quick", "0" * 16)
  >>> sorted(record)  # doctest: +NORMALIZE_WHITESPACE
  ['command', 'commit', 'date', 'dirty', 'fingerprint', 'machine',
   'package', 'versions']
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

import filelock
import jax

ROOT = pathlib.Path(__file__).parent.parent
# Which fingerprint each package tree had on which host and backend.
LEDGER = ROOT / "experiments" / "results" / "fingerprints.json"
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy")
# The fingerprint's smoke runs: the default configuration, and the one small
# sync messages need (embeddings projected, bfloat16 base and coordinates,
# random projectors), whose code paths the default never takes.
FINGERPRINT_RUNS = (
    (),
    (
        "optimizer.project_embeddings=true",
        "optimizer.base_dtype=bfloat16",
        "optimizer.coords_dtype=bfloat16",
        "optimizer.kind=random",
    ),
)
# Which fingerprint this is: 1 hashed the default smoke run alone, 2 the
# two of FINGERPRINT_RUNS. Fingerprints of two definitions are never joined.
FINGERPRINT_DEFINITION = 2
# The instruction set the fingerprint's smoke run is compiled for on CPU.
PINNED_ISA = "--xla_cpu_max_isa=AVX2"
# x86 vector extensions, widest first: the host's widest is recorded.
VECTOR_ISAS = ("avx512f", "avx2", "avx", "sse4_2")
# The metrics the numerics fingerprint hashes: what the optimizer, the loss,
# the sampler and the rewards compute. A fixed list, so that a metric added
# later (or the times and compile counts, which vary from run to run of the
# same code) changes no fingerprint.
NUMERIC_KEYS = (
    "step",
    "loss",
    "pg_loss",
    "grad_norm",
    "update_norm",
    "entropy",
    "ratio_mean",
    "kl/realized",
    "reward/total",
    "accuracy/train",
    "completion_length",
    "sync/bytes",
)


def _git(*args: str) -> str | None:
  """The output of a git command in the repository, or None when it fails
  (outside a repository, an old git)."""
  try:
    done = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    )
  except (OSError, subprocess.CalledProcessError):
    return None
  return done.stdout


def _tracked_changes(*pathspec: str) -> str | None:
  """``git status --porcelain`` of the tracked files under ``pathspec``."""
  return _git("status", "--porcelain", "--untracked-files=no", "--", *pathspec)


def commit() -> tuple[str, bool]:
  """``git rev-parse HEAD`` ("unknown" outside a repository) and whether
  the tracked files differ from it, the files studies write under
  ``experiments/results/`` (rows, reports, the fingerprint ledger) aside,
  though not the starting policies kept there, which runs read; dirty too
  when git cannot tell."""
  head = (_git("rev-parse", "HEAD") or "").strip() or "unknown"
  changes = [
      _tracked_changes(".", ":(exclude)experiments/results"),
      _tracked_changes(":(glob)experiments/results/*/policies/**"),
  ]
  return head, any(c is None or c.strip() for c in changes)


def code_version() -> str:
  """The cache key of the fingerprint: commit, the hash of the package's
  uncommitted changes, the JAX backend, and a hash of the host, the
  package versions and the fingerprint's definition (so that a cache
  carried to another host, or kept across an upgrade, gives no stale
  value)."""
  head, _ = commit()
  changes = hashlib.sha256(
      (_git("diff", "HEAD", "--", "logra_jax") or "").encode()
  ).hexdigest()[:12]
  where = json.dumps(
      [host(), versions(), FINGERPRINT_DEFINITION, FINGERPRINT_RUNS],
      sort_keys=True,
  )
  context = hashlib.sha256(where.encode()).hexdigest()[:8]
  return f"{head[:12]}-{changes}-{jax.default_backend()}-{context}"


def package() -> str:
  """The git tree of ``logra_jax/`` at HEAD: the code whose numerics a
  fingerprint measures; '' when it has uncommitted changes (then no tree
  names it) or outside a repository."""
  changed = _tracked_changes("logra_jax")
  if changed is None or changed.strip():
    return ""
  return (_git("rev-parse", "HEAD:logra_jax") or "").strip()


def metrics_hash(lines: list[str]) -> str:
  """SHA-256 (16 hex digits) of the :data:`NUMERIC_KEYS` of metrics JSON
  lines (other keys are left out).

  Example:
    >>> a = metrics_hash(['{"loss": 1.5, "time/step_s": 0.2}'])
    >>> a == metrics_hash(['{"loss": 1.5, "time/step_s": 0.9, "new": 1}'])
    True
    >>> a == metrics_hash(['{"loss": 1.25, "time/step_s": 0.2}'])
    False
  """
  stable = [
      {k: v for k, v in json.loads(line).items() if k in NUMERIC_KEYS}
      for line in lines
      if line.strip()
  ]
  text = json.dumps(stable, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def fingerprint(cache: str | os.PathLike) -> str:
  """The numerics fingerprint of this tree on this backend (a smoke run's
  metrics hash), from ``cache`` when this code version's is there. The
  smoke runs train their warm start in an empty cache of their own, so the
  fingerprint covers the warm start's code too, and start with no XLA flags
  but :data:`PINNED_ISA`, whatever the caller's.

  Raises:
    RuntimeError: the smoke run failed (its log's tail).
  """
  path = pathlib.Path(cache) / f"{code_version()}.json"
  if path.exists():
    return json.loads(path.read_text())["fingerprint"]
  lines = []
  with tempfile.TemporaryDirectory() as folder:
    for i, overrides in enumerate(FINGERPRINT_RUNS):
      run = pathlib.Path(folder) / f"run{i}"
      done = subprocess.run(
          [sys.executable, "-m", "logra_jax.cli", "train", "--preset", "smoke"]
          + ["--out", str(run), "--no-progress"]
          # The warm start is trained by the code measured, never read from
          # a cache an older version of it filled.
          + [f"--set=policy.cache_dir={pathlib.Path(folder) / 'warm_start'}"]
          + [f"--set={o}" for o in overrides],
          capture_output=True,
          text=True,
          cwd=ROOT,
          # None of the caller's XLA flags: they may change the numerics
          # (``reduction.CPU_FLAGS``, which logprob_agreement
          # --batch-invariant sets in its process, gave one tree another
          # fingerprint).
          env=dict(os.environ, XLA_FLAGS=PINNED_ISA),
      )
      if done.returncode:
        raise RuntimeError(
            "the fingerprint's smoke run failed: " + done.stderr[-2000:]
        )
      lines += (run / "metrics.jsonl").read_text().splitlines()
  value = metrics_hash(lines)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"fingerprint": value}) + "\n")
  return value


def _cpuinfo(field: str) -> list[str]:
  """The values of a ``/proc/cpuinfo`` field, one per processor (none
  where the file is missing)."""
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return []
  return [
      line.split(":", 1)[1].strip()
      for line in text.splitlines()
      if line.split(":", 1)[0].strip() == field
  ]


def cpu_isa() -> str:
  """The host's widest x86 vector extension (of :data:`VECTOR_ISAS`, read
  from ``/proc/cpuinfo``), or the machine's architecture elsewhere."""
  flags = set().union(*(line.split() for line in _cpuinfo("flags")))
  return next((isa for isa in VECTOR_ISAS if isa in flags), platform.machine())


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), or the processor's name
  where that file is missing."""
  names = _cpuinfo("model name")
  return names[0] if names else platform.processor() or platform.machine()


def cpu_features() -> str:
  """The CPU's family and model numbers and a digest of its feature flags
  (``/proc/cpuinfo``): two hosts of one model name can differ in both, and
  so in the kernels a library picks at run time (XNNPACK's matmuls, which
  ``--xla_cpu_max_isa`` does not pin: two "Intel Xeon Processor" hosts gave
  two fingerprints of one package). Empty where the file is missing."""
  flags = " ".join(sorted(set().union(*(f.split() for f in _cpuinfo("flags")))))
  numbers = [_cpuinfo(field)[:1] for field in ("cpu family", "model")]
  if not flags and not any(numbers):
    return ""
  family, model = (n[0] if n else "?" for n in numbers)
  digest = hashlib.sha256(flags.encode()).hexdigest()[:8]
  return f"family {family} model {model}, flags {digest}"


def host() -> str:
  """What the same code's fingerprint varies with besides the code: the
  CPU's model, widest vector extension and features, or the accelerator's
  kind."""
  if jax.default_backend() == "cpu":
    features = cpu_features()
    return f"{cpu_model()} ({cpu_isa()}" + (
        f"; {features})" if features else ")"
    )
  return ", ".join(sorted({d.device_kind for d in jax.devices()}))


class LedgerError(ValueError):
  """The ledger cannot be read (damaged, or not a ledger)."""


def read_ledger(path: str | os.PathLike = LEDGER) -> list[dict[str, Any]]:
  """The ledger's entries (none where it is missing), each a commit, its
  package tree, a backend, a host, the fingerprint's definition and the
  fingerprint measured there.

  Raises:
    LedgerError: the file is not a ledger (damaged or hand-edited), named.
  """
  path = pathlib.Path(path)
  if not path.exists():
    return []
  try:
    entries = json.loads(path.read_text())["measured"]
    if not all(isinstance(e["fingerprint"], str) for e in entries):
      raise TypeError("a fingerprint that is not a string")
  except (ValueError, KeyError, TypeError) as error:
    raise LedgerError(
        f"{path} is not a fingerprint ledger ({type(error).__name__}: "
        f"{error}); restore it from git"
    ) from None
  return entries


def note_fingerprint(value: str, path: str | os.PathLike = LEDGER) -> None:
  """Adds this commit's fingerprint on this host to the ledger, under a
  lock (studies may start together): a tree whose package (``logra_jax/``)
  has uncommitted changes, or one outside a repository, adds nothing: its
  fingerprint names no commit. Results written since are no change."""
  tree = package()
  if not tree:
    return
  entry = {
      "commit": commit()[0],
      "package": tree,
      "backend": jax.default_backend(),
      "host": host(),
      "definition": FINGERPRINT_DEFINITION,
      "fingerprint": value,
  }
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with filelock.FileLock(str(path) + ".lock"):
    entries = read_ledger(path)
    if any(all(e.get(k) == v for k, v in entry.items()) for e in entries):
      return
    entry["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    entries = sorted(entries + [entry], key=lambda e: (e["date"], e["commit"]))
    handle, staged = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
      out.write(json.dumps({"measured": entries}, indent=1) + "\n")
    os.replace(staged, path)


def same_numerics(value: str, entries: list[dict[str, Any]]) -> set[str]:
  """The fingerprints that name the same code as ``value`` under its
  definition of the fingerprint: those one package tree (its ``package``,
  or its ``commit`` where none is noted) had on other hosts of one backend,
  transitively (under one definition, a fingerprint names the numerics of
  every package that has it on that host). Entries of another definition
  are never joined: the code it measures is another.

  Example:
    >>> ledger = [
    ...     {"commit": "c1", "backend": "cpu", "fingerprint": "a"},
    ...     {"commit": "c1", "backend": "cpu", "fingerprint": "b"},
    ...     {"commit": "c2", "backend": "cpu", "fingerprint": "b"},
    ...     {"commit": "c2", "backend": "cpu", "fingerprint": "c"},
    ...     {"commit": "c3", "backend": "cpu", "fingerprint": "d"},
    ...     {"commit": "c1", "backend": "gpu", "fingerprint": "e"},
    ...     {"commit": "c4", "package": "p", "backend": "cpu",
    ...      "fingerprint": "f"},
    ...     {"commit": "c5", "package": "p", "backend": "cpu",
    ...      "fingerprint": "g"},
    ... ]
    >>> sorted(same_numerics("a", ledger))
    ['a', 'b', 'c']
    >>> sorted(same_numerics("f", ledger))  # c4 and c5: one package
    ['f', 'g']
    >>> ledger.append({"commit": "c4", "package": "p", "backend": "cpu",
    ...                "definition": 2, "fingerprint": "h"})
    >>> sorted(same_numerics("h", ledger))  # another definition: alone
    ['h']
    >>> sorted(same_numerics("z", ledger))
    ['z']
  """
  definitions = {
      e.get("definition", 1) for e in entries if e["fingerprint"] == value
  }
  groups: dict[tuple[str, str], set[str]] = {}
  for e in entries:
    if e.get("definition", 1) in definitions:
      code = e.get("package") or e["commit"]
      groups.setdefault((code, e["backend"]), set()).add(e["fingerprint"])
  found, grew = {value}, True
  while grew:
    grew = False
    for group in groups.values():
      if group & found and not group <= found:
        found |= group
        grew = True
  return found


def machine() -> dict[str, Any]:
  """Platform, CPU count, model and vector extension, and the JAX
  backend's devices."""
  return {
      "platform": platform.platform(),
      "cpu_count": os.cpu_count(),
      "cpu_model": cpu_model(),
      "cpu_isa": cpu_isa(),
      "jax_backend": jax.default_backend(),
      "devices": [d.device_kind for d in jax.devices()],
  }


def versions() -> dict[str, str]:
  """Python's and the numerical packages' versions."""
  found = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = "absent"
  return found


def this_command() -> str:
  """The command line of this process, quoted for a shell."""
  return shlex.join(["python", *sys.argv])


def collect(command: str, fingerprint_value: str) -> dict[str, Any]:
  """The provenance record of a results file."""
  head, dirty = commit()
  return {
      "commit": head,
      "dirty": dirty,
      "fingerprint": fingerprint_value,
      "package": package(),
      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "machine": machine(),
      "versions": versions(),
      "command": command,
  }


def footer(record: dict[str, Any]) -> str:
  """The line under every table: command, commit, fingerprint, date,
  machine and versions (and the commits that made a report's rows, where
  they were made earlier, with how many were made with uncommitted changes
  to the package).

  Example:
    >>> footer(collect("python x.py", "ab12")).startswith(
    ...     "Command: `python x.py`; commit ")
    True
  """
  m, v = record["machine"], record["versions"]
  short = lambda commits: " ".join(c[:12] for c in commits.split())
  rows = record.get("rows_commits")
  rows = None if rows == record["commit"] else rows
  uncommitted = record.get("rows_uncommitted", 0)
  return (
      f"Command: `{record['command']}`; commit {short(record['commit'])}"
      f"{' (dirty tree)' if record['dirty'] else ''}"
      + (f", rows made at commit {short(rows)}" if rows else "")
      + (
          f", {uncommitted} rows made with uncommitted changes to the "
          "package (which they record as none)"
          if uncommitted
          else ""
      )
      + ", numerics fingerprint "
      f"{record['fingerprint']}; {record['date']}; {m['platform']}, "
      f"{m['cpu_count']} CPUs ("
      + ", ".join(m[k] for k in ("cpu_model", "cpu_isa") if k in m)
      + "), "
      f"{m['jax_backend']} "
      f"({', '.join(sorted(set(m['devices'])))}); "
      + ", ".join(f"{k} {v[k]}" for k in ("python", *PACKAGES))
      + "."
  )


def png_metadata(record: dict[str, Any]) -> dict[str, str]:
  """The record as PNG text chunks (``savefig(metadata=...)``)."""
  return {"Description": json.dumps(record, sort_keys=True)}
