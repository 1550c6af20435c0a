"""The loss section of a run config: the policy-gradient loss, its KL term
and aggregation, and DAPO's overlong shaping (``loss.*``).

Like every section of :mod:`logra_jax.configs.schema`, it is checked when
built, refusing an out-of-range value naming its dotted path; the checks
that need another section (``loss.overlong_buffer`` against
``rollout.max_new_tokens``) are ``TrainConfig``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from logra_jax.checks import check_choice, check_range

# KL-to-reference estimators and loss aggregations (``rl.algo``), policy
# losses (``rl.losses.POLICY_LOSSES``) and the levels of their importance
# ratios.
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("clip", "gspo", "gspo_token", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")
# Corrections of the sampler-to-learner mismatch (``rl.losses.rollout_weights``).
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Hyperparameters of the policy-gradient loss and of DAPO's overlong
  shaping (hashable: a static jit argument of ``rl.algo.loss_terms``).

  Attributes:
    policy_loss: one of :data:`POLICY_LOSSES` (``rl.losses``): ``"clip"``
      (PPO/GRPO's clipped token ratio), ``"gspo"`` (the sequence ratio, the
      geometric mean of the token ratios, clipped per sequence),
      ``"gspo_token"`` (GSPO with a gradient per token) or ``"cispo"`` (the
      clipped ratio as a stop-gradient weight of ``log pi``: no token's
      gradient is dropped).
    importance_level: ``"token"`` or ``"sequence"``: the ratio that
      ``cispo`` clips (the paper's is ``"token"``); None: the loss's own
      (token for ``clip`` and ``cispo``, sequence for ``gspo`` and
      ``gspo_token``). ``clip`` is token-level and GSPO sequence-level by
      definition.
    eps_low: the ratio is clipped below at ``1 - eps_low``.
    eps_high: the ratio is clipped above at ``1 + eps_high`` (DAPO
      "clip-higher": larger than ``eps_low``, e.g. 0.28 vs 0.2).
    beta: coefficient of the KL-to-reference penalty; 0 disables it and
      reference log-probabilities are then not needed.
    kl_estimator: one of :data:`KL_ESTIMATORS` (see ``rl.algo.kl_penalty``).
    kl_clamp: bound on the per-token log-ratio to the reference, before
      ``exp``.
    aggregation: how per-token losses become one number, one of
      :data:`AGGREGATIONS`: ``"token-mean"`` (sum over all valid tokens /
      their count), ``"seq-mean-token-mean"`` (GRPO: mean over sequences of
      per-sequence token means) or ``"seq-mean-token-sum-norm"`` (Dr.GRPO:
      sum over tokens / (sequences * max_len)).
    max_len: the constant token normalizer of ``"seq-mean-token-sum-norm"``:
      the same for every micro-batch (typically the generation budget, max
      new tokens). Required by that aggregation, ignored by the others.
    overlong_buffer: DAPO's soft overlong punishment: a completion of ``L >
      rollout.max_new_tokens - overlong_buffer`` tokens gets ``-(L -
      (max_new_tokens - overlong_buffer)) / overlong_buffer *
      overlong_penalty`` added to its reward (``rl.losses.overlong_penalty``);
      0 disables it. Smaller than ``rollout.max_new_tokens``.
    overlong_penalty: the penalty at ``rollout.max_new_tokens``.
    mask_truncated: completions cut by ``rollout.max_new_tokens`` (no stop
      token) are masked from the loss (DAPO's overlong filtering); they keep
      their place in their group's advantages.
    rollout_correction: one of :data:`ROLLOUT_CORRECTIONS`: how the loss
      corrects for the sampler's log-probs not being the learner's
      (``rl.algo.loss_terms``): ``"tis"`` (the default: truncated importance
      sampling, on because no rollout engine's log-probs are bitwise the
      learner's), ``"mis"`` (masked importance sampling) or ``"none"`` (the
      sampler's log-probs are the ratio's old policy, uncorrected).
    rollout_correction_cap: the importance weight's cap ``C`` of ``"tis"``
      (weights above it are cut to it) and ``"mis"`` (tokens whose weight is
      above it are dropped); finite and > 0 (TRL's and verl's default 2).
  """

  policy_loss: str = "clip"
  importance_level: Optional[str] = None
  eps_low: float = 0.2
  eps_high: float = 0.2
  beta: float = 0.0
  kl_estimator: str = "k3"
  kl_clamp: float = 10.0
  aggregation: str = "token-mean"
  max_len: Optional[int] = None
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  mask_truncated: bool = False
  rollout_correction: str = "tis"
  rollout_correction_cap: float = 2.0

  def __post_init__(self):
    check_choice("loss.policy_loss", self.policy_loss, POLICY_LOSSES)
    if self.importance_level is not None:
      check_choice(
          "loss.importance_level", self.importance_level, IMPORTANCE_LEVELS
      )
    own = "token" if self.policy_loss == "clip" else "sequence"
    if self.policy_loss != "cispo" and self.importance_level not in (
        None,
        own,
    ):
      raise ValueError(
          f"loss.importance_level={self.importance_level!r} does not apply "
          f"to loss.policy_loss={self.policy_loss!r}, which is {own}-level "
          "by definition ("
          + (
              "GSPO is clip at the sequence level: loss.policy_loss=gspo)"
              if own == "token"
              else "loss.policy_loss=clip is the token " "level)"
          )
      )
    check_range("loss.eps_low", self.eps_low, ge=0, lt=1)  # ratio floor > 0
    check_range("loss.eps_high", self.eps_high, ge=0)
    check_range("loss.beta", self.beta, ge=0)
    check_range("loss.kl_clamp", self.kl_clamp, gt=0)
    if self.max_len is not None:
      check_range("loss.max_len", self.max_len, ge=1)
    check_range("loss.overlong_buffer", self.overlong_buffer, ge=0)
    check_range("loss.overlong_penalty", self.overlong_penalty, ge=0)
    check_choice("loss.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    check_choice("loss.aggregation", self.aggregation, AGGREGATIONS)
    check_choice(
        "loss.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS
    )
    check_range(
        "loss.rollout_correction_cap", self.rollout_correction_cap, gt=0
    )
    if self.aggregation == "seq-mean-token-sum-norm" and self.max_len is None:
      raise ValueError(
          "loss.aggregation='seq-mean-token-sum-norm' needs loss.max_len, "
          "the global constant token normalizer (e.g. the max new tokens of "
          "generation)"
      )
