"""RL math as pure functions: group advantages, the policy loss, KL to a reference.

Everything here is jit-friendly: shapes and configuration are static, values are traced.
Shapes are spelled in the names: ``B`` sequences (``num_prompts * G`` completions grouped
contiguously by prompt), ``T`` completion tokens, ``P`` prompt tokens, ``M`` micro-batches.

The loss is returned as a ``(numerator, denominator, metrics)`` triple so that micro-batches
can be summed and divided once at the end (:func:`finalize`); for every aggregation this gives
exactly the full-batch loss and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

from logra_jax.configs import KL_ESTIMATORS
from logra_jax.configs import LossConfig
from logra_jax.rl import losses

Array = jax.Array
Metrics = losses.Metrics

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
KLEstimator = Literal["k1", "k2", "k3"]


# ------------------------------------------------------------------------------------------
# Advantages.
# ------------------------------------------------------------------------------------------


def _grouped(rewards_N: Array, num_generations: int) -> Array:
  """Reshapes ``[num_prompts * G]`` rewards to ``[num_prompts, G]`` float32."""
  if num_generations < 2:
    raise ValueError(
        f"group advantages need num_generations >= 2 completions per prompt, got "
        f"{num_generations}: with one completion the group baseline equals the reward."
    )
  if rewards_N.ndim != 1 or rewards_N.shape[0] % num_generations:
    raise ValueError(
        f"rewards must have shape [num_prompts * num_generations] grouped contiguously; got "
        f"shape {rewards_N.shape} with num_generations={num_generations}."
    )
  return jnp.reshape(rewards_N.astype(jnp.float32), (-1, num_generations))


def grpo_advantages(
    rewards_N: Array, num_generations: int, eps: float = 1e-6
) -> Array:
  r"""GRPO advantages: rewards standardized within each prompt's group.

  .. math::
    A_i = \frac{R_i - \operatorname{mean}_g R}{\operatorname{std}_g R + \epsilon}

  with the population standard deviation (``ddof=0``) of the group ``g`` holding ``i``.

  Args:
    rewards_N: rewards ``[num_prompts * num_generations]``, the ``G`` completions of a prompt
      contiguous.
    num_generations: completions per prompt ``G`` (at least 2).
    eps: added to the standard deviation; a group of equal rewards gets advantage 0.

  Returns:
    Advantages ``[num_prompts * num_generations]`` in float32.

  Example:
    >>> grpo_advantages(jnp.array([1., 0., 0., 1., 1., 1.]), num_generations=3).round(4)
    Array([ 1.4142, -0.7071, -0.7071,  0.    ,  0.    ,  0.    ], dtype=float32)

  References:
    Shao et al., DeepSeekMath, 2024 (arXiv 2402.03300).
  """
  r_PxG = _grouped(rewards_N, num_generations)
  mean_Px1 = r_PxG.mean(axis=1, keepdims=True)
  std_Px1 = r_PxG.std(axis=1, keepdims=True)
  return ((r_PxG - mean_Px1) / (std_Px1 + eps)).reshape(-1)


def dr_grpo_advantages(rewards_N: Array, num_generations: int) -> Array:
  r"""Dr.GRPO advantages: rewards minus the group mean, without dividing by the std.

  .. math:: A_i = R_i - \operatorname{mean}_g R

  Args:
    rewards_N: rewards ``[num_prompts * num_generations]``, groups contiguous.
    num_generations: completions per prompt ``G`` (at least 2).

  Returns:
    Advantages ``[num_prompts * num_generations]`` in float32.

  Example:
    >>> dr_grpo_advantages(jnp.array([1., 0., 0., 1., 1., 1.]), num_generations=3).round(4)
    Array([ 0.6667, -0.3333, -0.3333,  0.    ,  0.    ,  0.    ], dtype=float32)

  References:
    Liu et al., Understanding R1-Zero-Like Training, 2025 (arXiv 2503.20783).
  """
  r_PxG = _grouped(rewards_N, num_generations)
  return (r_PxG - r_PxG.mean(axis=1, keepdims=True)).reshape(-1)


def rloo_advantages(rewards_N: Array, num_generations: int) -> Array:
  r"""RLOO advantages: each reward minus the mean of the other rewards in its group.

  .. math::
    A_i = R_i - \frac{1}{G - 1} \sum_{j \in g, j \ne i} R_j
        = \frac{G}{G - 1} (R_i - \operatorname{mean}_g R)

  Args:
    rewards_N: rewards ``[num_prompts * num_generations]``, groups contiguous.
    num_generations: completions per prompt ``G`` (at least 2).

  Returns:
    Advantages ``[num_prompts * num_generations]`` in float32.

  Example:
    >>> rloo_advantages(jnp.array([1., 0., 0., 1., 1., 1.]), num_generations=3)
    Array([ 1. , -0.5, -0.5,  0. ,  0. ,  0. ], dtype=float32)

  References:
    Ahmadian et al., Back to Basics: REINFORCE style optimization, 2024 (arXiv 2402.14740).
  """
  r_PxG = _grouped(rewards_N, num_generations)
  others_PxG = (r_PxG.sum(axis=1, keepdims=True) - r_PxG) / (
      num_generations - 1
  )
  return (r_PxG - others_PxG).reshape(-1)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[Array, int], Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(
    rewards_N: Array,
    num_generations: int,
    estimator: AdvantageEstimator = "grpo",
) -> Array:
  """Group advantages by estimator name (``"grpo"``, ``"dr_grpo"`` or ``"rloo"``).

  Args:
    rewards_N: rewards ``[num_prompts * num_generations]``, groups contiguous.
    num_generations: completions per prompt (at least 2).
    estimator: one of :data:`ADVANTAGE_ESTIMATORS`.

  Returns:
    Advantages ``[num_prompts * num_generations]`` in float32.

  Example:
    >>> compute_advantages(jnp.array([1., 0., 1., 1.]), 2, "rloo")
    Array([ 1., -1.,  0.,  0.], dtype=float32)
  """
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ValueError(
        f"unknown advantage estimator {estimator!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}."
    )
  return ADVANTAGE_ESTIMATORS[estimator](rewards_N, num_generations)


# ------------------------------------------------------------------------------------------
# KL to the reference policy.
# ------------------------------------------------------------------------------------------


def kl_penalty(
    logp_BxT: Array,
    ref_logp_BxT: Array,
    estimator: KLEstimator = "k3",
    clamp: float = 10.0,
) -> Array:
  r"""Per-token estimate of :math:`KL(\pi_\theta \| \pi_{ref})` from sampled tokens.

  With the log-ratio :math:`\delta = \log \pi_{ref}(y) - \log \pi_\theta(y)` clamped to
  ``[-clamp, clamp]`` (before any ``exp``), Schulman's estimators are

  .. math::
    k_1 = -\delta, \qquad k_2 = \tfrac12 \delta^2, \qquad k_3 = e^{\delta} - \delta - 1.

  ``k1`` is unbiased but signed, ``k2`` and ``k3`` are non-negative; ``k3`` is unbiased with
  low variance (the usual default). The clamp zeroes the gradient outside the range.

  Args:
    logp_BxT: log-probabilities of the sampled tokens under the policy.
    ref_logp_BxT: log-probabilities of the same tokens under the reference policy.
    estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
    clamp: bound on ``|delta|``; must be positive.

  Returns:
    Per-token KL estimates ``[B, T]`` in float32 (padding positions are not masked).

  Example:
    >>> kl_penalty(jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]])), "k3")
    Array([[0.19314718]], dtype=float32)

  References:
    J. Schulman, Approximating KL Divergence, 2020 (joschu.net/blog/kl-approx.html).
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(
        f"unknown KL estimator {estimator!r}; valid: {list(KL_ESTIMATORS)}."
    )
  delta_BxT = jnp.clip(
      ref_logp_BxT.astype(jnp.float32) - logp_BxT.astype(jnp.float32),
      -clamp,
      clamp,
  )
  if estimator == "k1":
    return -delta_BxT
  if estimator == "k2":
    return 0.5 * jnp.square(delta_BxT)
  return jnp.exp(delta_BxT) - delta_BxT - 1.0


# ------------------------------------------------------------------------------------------
# The policy-gradient loss.
# ------------------------------------------------------------------------------------------


def _logprob_gap(
    logp_BxT: Array, old_logp_BxT: Array, mask_BxT: Array
) -> Metrics:
  r"""``rollout/logprob_gap_mean`` and ``_max``: :math:`|\log\pi_\theta - \log\pi_{old}|`
  over the valid tokens. With ``num_iterations=1`` and ``rollout.max_staleness=0`` the
  learner's parameters are the sampler's, so this is how far the sampler's log-probs are
  from the learner's forward pass (0 where they are bitwise equal)."""
  gap_BxT = jnp.abs(jax.lax.stop_gradient(logp_BxT) - old_logp_BxT) * mask_BxT
  tokens = mask_BxT.sum()
  return {
      "rollout/logprob_gap_mean": (gap_BxT.sum(), tokens),
      "rollout/logprob_gap_max": (
          gap_BxT.max(),
          (tokens > 0).astype(jnp.float32),
      ),
  }


def _policy_loss(
    logp_BxT, rollout_logp_BxT, proximal_logp_BxT, mask_BxT, adv_B, config
) -> tuple[Array, Metrics]:
  """The per-token policy loss of :func:`loss_terms` (weighted under a rollout
  correction) and its metrics, from clean float32 inputs."""
  if config.rollout_correction == "none":
    old_logp_BxT, weight_BxT, metrics = rollout_logp_BxT, None, {}
  else:
    old_logp_BxT = proximal_logp_BxT
    weight_BxT, metrics = losses.rollout_weights(
        proximal_logp_BxT,
        rollout_logp_BxT,
        mask_BxT,
        config.rollout_correction,
        config.rollout_correction_cap,
    )
  extra = {}
  if config.policy_loss == "cispo":
    extra = {"importance_level": config.importance_level or "token"}
  pg_loss_BxT, pg_metrics = losses.POLICY_LOSSES[config.policy_loss](
      logp_BxT,
      old_logp_BxT,
      mask_BxT,
      adv_B,
      config.eps_low,
      config.eps_high,
      **extra,
  )
  metrics.update(pg_metrics)
  metrics.update(_logprob_gap(logp_BxT, rollout_logp_BxT, mask_BxT))
  if weight_BxT is not None:
    pg_loss_BxT = weight_BxT * pg_loss_BxT
  return pg_loss_BxT, metrics


def loss_terms(
    logp_BxT: Array,
    mask_BxT: Array,
    adv_B: Array,
    old_logp_BxT: Array | None = None,
    ref_logp_BxT: Array | None = None,
    config: LossConfig = LossConfig(),
    proximal_logp_BxT: Array | None = None,
) -> tuple[Array, Array, Metrics]:
  r"""Policy-gradient loss of one (micro-)batch as a (numerator, denominator) pair.

  Per valid token, the policy loss :math:`\ell^{pg}` named by ``config.policy_loss``
  (:data:`losses.POLICY_LOSSES`: ``clip``, the default, ``gspo``, ``gspo_token`` or
  ``cispo``) plus the KL term,

  .. math::
    \ell = \ell^{pg} + \beta\, \mathrm{KL}_k(\pi_\theta \| \pi_{ref}), \qquad
    \ell^{pg}_{clip} = -\min\big(\rho A,\ \operatorname{clip}(\rho, 1 - \epsilon_{low},
           1 + \epsilon_{high}) A\big)

  with ratio :math:`\rho = \exp(\log\pi_\theta - \log\pi_{old})` and the sequence's
  advantage :math:`A`.

  **Rollout correction** (``config.rollout_correction``): the sampler's log-probs
  :math:`q` (``old_logp_BxT``) are not bitwise the learner's (another dtype, kernels or
  process, a stale policy). Under ``"tis"`` (the default) or ``"mis"`` the loss is
  decoupled PPO: :math:`\rho = \exp(\log\pi_\theta - p)` with the *proximal*
  log-probs :math:`p`, the learner's under the weights at the batch's first update
  (``proximal_logp_BxT``; ``None``: :math:`\mathrm{sg}(\log\pi_\theta)`, exact with
  one update per batch), and each token's policy loss is multiplied by the
  stop-gradient weight :math:`w = \exp(p - q)`, truncated or masked at
  ``config.rollout_correction_cap`` (:func:`losses.rollout_weights`):
  :math:`\ell = \operatorname{trunc}_C(w)\, \ell^{pg}(\rho) + \beta\,\mathrm{KL}`.
  The weight is per token for every policy loss, the sequence-level ones too (each
  token's share of its sequence's loss carries its own weight, TRL's ``token_*`` and
  verl's token-level modes; a sequence weight, a product of token ratios, under- or
  overflows on long completions); the KL term is not weighted (as in TRL and verl).
  ``"none"``: :math:`\rho = \exp(\log\pi_\theta - q)`, no weight.

  The aggregation gives ``numerator`` and ``denominator`` such that summing both over
  micro-batches and calling :func:`finalize` once equals the full-batch loss exactly:

  * ``token-mean``: :math:`\sum_{b,t} m_{bt} \ell_{bt}` over :math:`\sum_{b,t} m_{bt}`;
  * ``seq-mean-token-mean``: :math:`\sum_b \big(\sum_t m_{bt} \ell_{bt} / \sum_t m_{bt}\big)`
    over the number of sequences;
  * ``seq-mean-token-sum-norm``: :math:`\sum_{b,t} m_{bt} \ell_{bt}` over the number of
    sequences times ``config.max_len``.

  "Sequences" counts rows with at least one valid token, so all-padding rows (used to
  keep shapes static) change nothing. The denominator carries no gradient; accumulate
  gradients of the numerator and divide by the summed denominator.

  Args:
    logp_BxT: policy log-probabilities of the completion tokens (differentiated).
    mask_BxT: 1 for completion tokens, 0 for padding (bool, int or float); values of the
      other inputs at padding are ignored, even if infinite or NaN.
    adv_B: one advantage per sequence.
    old_logp_BxT: log-probabilities under the policy that sampled the data (the
      sampler's); ``None`` means on-policy (``stop_gradient(logp_BxT)``, ratio 1).
    ref_logp_BxT: reference-policy log-probabilities; needed when ``config.beta > 0``, may be
      ``None`` otherwise. When given with ``beta == 0`` the KL is still reported.
    config: a :class:`LossConfig`.
    proximal_logp_BxT: with a rollout correction, the learner's log-probabilities under
      the weights at the batch's first update (needed when a batch gets several
      updates); ``None``: ``stop_gradient(logp_BxT)``. Unused by ``"none"``.

  Returns:
    ``(numerator, denominator, metrics)``: two float32 scalars and a dict mapping metric name
    to a ``(sum, count)`` pair of scalars (the policy loss's metrics, e.g. ``clip_fraction``,
    ``clip_low_fraction``, ``clip_high_fraction``, ``ratio_mean`` for ``clip``; ``pg_loss``
    over tokens, ``kl_ref`` when a reference is given, ``rollout/logprob_gap_*``, and
    ``rollout/is_weight_mean`` and ``rollout/is_truncated_fraction`` under a rollout
    correction); see :func:`finalize_metrics`.

  Example:
    >>> logp = jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.0]]))
    >>> num, den, _ = loss_terms(logp, jnp.array([[1, 1], [1, 0]]), jnp.array([1., -1.]))
    >>> finalize(num, den)   # on-policy, padding ignored: -(1 + 1 - 1) / 3
    Array(-0.33333334, dtype=float32)

  Raises:
    ValueError: when ``config.beta > 0`` and ``ref_logp_BxT`` is None, or shapes disagree.

  References:
    Hilton, Cobbe, Schulman, Batch size-invariance for policy optimization, 2022 (arXiv
    2110.00641), the decoupled objective; for TIS and MIS see
    :func:`losses.rollout_weights`.
  """
  if (
      logp_BxT.ndim != 2
      or mask_BxT.shape != logp_BxT.shape
      or adv_B.shape != logp_BxT.shape[:1]
  ):
    raise ValueError(
        f"expected logp [B, T], mask [B, T], adv [B]; got logp {logp_BxT.shape}, mask "
        f"{mask_BxT.shape}, adv {adv_B.shape}."
    )
  if config.beta > 0 and ref_logp_BxT is None:
    raise ValueError(
        f"beta={config.beta} > 0 needs ref_logp_BxT (reference log-probabilities); pass them "
        "or set beta=0."
    )
  # Padding may hold anything (-inf, NaN): zero it before any arithmetic, so neither the
  # sums nor the gradients see it.
  valid_BxT = mask_BxT.astype(bool)
  clean = lambda x_BxT: jnp.where(valid_BxT, x_BxT.astype(jnp.float32), 0.0)
  logp_BxT = clean(logp_BxT)
  own = lambda x_BxT: (
      jax.lax.stop_gradient(logp_BxT) if x_BxT is None else clean(x_BxT)
  )
  mask_BxT = valid_BxT.astype(jnp.float32)
  pg_loss_BxT, metrics = _policy_loss(
      logp_BxT,
      own(old_logp_BxT),
      own(proximal_logp_BxT),
      mask_BxT,
      adv_B.astype(jnp.float32),
      config,
  )
  loss_BxT = pg_loss_BxT
  kl_BxT = None
  if ref_logp_BxT is not None:
    kl_BxT = kl_penalty(
        logp_BxT, clean(ref_logp_BxT), config.kl_estimator, config.kl_clamp
    )
    if config.beta > 0:
      loss_BxT = loss_BxT + config.beta * kl_BxT

  tokens_B = mask_BxT.sum(axis=1)
  token_sum_B = (loss_BxT * mask_BxT).sum(axis=1)
  num_seqs = (tokens_B > 0).sum().astype(jnp.float32)
  if config.aggregation == "token-mean":
    numerator, denominator = token_sum_B.sum(), tokens_B.sum()
  elif config.aggregation == "seq-mean-token-mean":
    numerator = (token_sum_B / jnp.maximum(tokens_B, 1.0)).sum()
    denominator = num_seqs
  else:  # "seq-mean-token-sum-norm", checked by LossConfig.
    numerator, denominator = token_sum_B.sum(), num_seqs * float(config.max_len)

  num_tokens = tokens_B.sum()
  masked_sum = lambda x_BxT: (x_BxT.astype(jnp.float32) * mask_BxT).sum()
  metrics["pg_loss"] = (masked_sum(pg_loss_BxT), num_tokens)
  if kl_BxT is not None:
    metrics["kl_ref"] = (masked_sum(kl_BxT), num_tokens)
  metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
  return numerator, jax.lax.stop_gradient(denominator), metrics


def finalize(numerator: Array, denominator: Array) -> Array:
  """Divides an accumulated numerator by its denominator; 0 when the denominator is 0.

  Args:
    numerator: the summed numerators of :func:`loss_terms` over micro-batches.
    denominator: the summed denominators.

  Returns:
    The scalar loss ``numerator / denominator`` (0 for an empty batch).

  Example:
    >>> finalize(jnp.float32(3.0), jnp.float32(4.0))
    Array(0.75, dtype=float32)
  """
  safe_den = jnp.where(denominator > 0, denominator, 1.0)
  return jnp.where(denominator > 0, numerator / safe_den, 0.0)


def finalize_metrics(metrics: Metrics) -> dict[str, Array]:
  """Turns accumulated ``(sum, count)`` metric pairs into means.

  Args:
    metrics: name -> ``(sum, count)``, e.g. from :func:`loss_terms` combined over
      micro-batches by :func:`losses.reduce_metrics`; an ``(extreme, any)`` pair of a
      ``_min`` / ``_max`` name gives its extreme.

  Returns:
    name -> ``sum / count`` (0 where the count is 0).

  Example:
    >>> finalize_metrics({"clip_fraction": (jnp.float32(1.), jnp.float32(4.))})
    {'clip_fraction': Array(0.25, dtype=float32)}
  """
  return {
      name: finalize(total, count) for name, (total, count) in metrics.items()
  }


# ------------------------------------------------------------------------------------------
# The learner's batch.
# ------------------------------------------------------------------------------------------


@flax.struct.dataclass(kw_only=True)
class RolloutBatch:
  """One step's rollouts, ready for the learner (a pytree; ``num_generations`` is static).

  Rows are completions, ``num_generations`` consecutive rows per prompt; prompts are
  left-padded, completions right-padded. Fields are keyword-only. A row may be a whole
  episode: the model's turns and the environment's tokens, all attended to
  (``context_mask_BxT``), the model's alone scored (``completion_mask_BxT``).

  Attributes:
    prompt_tokens_BxP: int32 prompt token ids (each prompt repeated for its group).
    prompt_mask_BxP: 1 on prompt tokens, 0 on left padding.
    completion_tokens_BxT: int32 sampled token ids.
    completion_mask_BxT: 1 on completion tokens up to and including the stop token.
    old_logp_BxT: float32 log-probabilities of the sampled tokens under the sampling policy.
    advantages_B: float32 per-completion advantages.
    num_generations: completions per prompt (static).
    ref_logp_BxT: float32 reference log-probabilities, or ``None`` when ``beta == 0``.
    proximal_logp_BxT: float32 log-probabilities under the learner's weights at the
      batch's first update (``rl.learner.make_proximal_logprobs``), or ``None``: then
      each update takes its own (right when a batch gets one update).
    context_mask_BxT: 1 on the completion's tokens attended to (an episode's model
      and environment tokens); ``None``: ``completion_mask_BxT``.
  """

  prompt_tokens_BxP: Array
  prompt_mask_BxP: Array
  completion_tokens_BxT: Array
  completion_mask_BxT: Array
  old_logp_BxT: Array
  advantages_B: Array
  num_generations: int = flax.struct.field(pytree_node=False)
  ref_logp_BxT: Array | None = None
  proximal_logp_BxT: Array | None = None
  context_mask_BxT: Array | None = None

  @property
  def batch_size(self) -> int:
    """Number of completions ``B``."""
    return self.completion_tokens_BxT.shape[0]

  def micro_batches(self, num_micro_batches: int) -> RolloutBatch:
    """Reshapes every array's leading ``B`` to ``[M, B / M]`` for ``lax.scan``.

    Args:
      num_micro_batches: ``M``; must divide ``B``.

    Returns:
      A ``RolloutBatch`` whose arrays have a leading micro-batch axis (``[M, B/M, ...]``).

    Example:
      >>> z = jnp.zeros((8, 5))
      >>> batch = RolloutBatch(
      ...     prompt_tokens_BxP=z, prompt_mask_BxP=z, completion_tokens_BxT=z,
      ...     completion_mask_BxT=z, old_logp_BxT=z, advantages_B=z[:, 0], num_generations=2)
      >>> batch.micro_batches(4).completion_tokens_BxT.shape
      (4, 2, 5)
    """
    if num_micro_batches < 1 or self.batch_size % num_micro_batches:
      raise ValueError(
          f"num_micro_batches={num_micro_batches} must be >= 1 and divide the batch size "
          f"{self.batch_size}."
      )
    return jax.tree.map(
        lambda x: x.reshape((num_micro_batches, -1) + x.shape[1:]), self
    )

  def trimmed(self, prompt_width: int, completion_width: int) -> RolloutBatch:
    """The batch cut to its last ``prompt_width`` prompt columns and its
    first ``completion_width`` completion columns: prompts are left-padded
    and completions right-padded, so only padding may go (positions count
    real tokens only, so log-probabilities do not change).

    Args:
      prompt_width: ``P' <= P``, at least the longest prompt.
      completion_width: ``T' <= T``, at least the longest completion.

    Returns:
      The same rollouts, ``P'`` and ``T'`` columns wide.

    Example:
      >>> z = jnp.zeros((2, 8))
      >>> batch = RolloutBatch(
      ...     prompt_tokens_BxP=z, prompt_mask_BxP=z, completion_tokens_BxT=z,
      ...     completion_mask_BxT=z, old_logp_BxT=z, advantages_B=z[:, 0], num_generations=2)
      >>> trimmed = batch.trimmed(6, 4)
      >>> trimmed.prompt_tokens_BxP.shape, trimmed.old_logp_BxT.shape
      ((2, 6), (2, 4))
    """
    for name, width, total in (
        ("prompt_width", prompt_width, self.prompt_tokens_BxP.shape[1]),
        (
            "completion_width",
            completion_width,
            self.completion_tokens_BxT.shape[1],
        ),
    ):
      if not 1 <= width <= total:
        raise ValueError(f"{name}={width} must be in [1, {total}]")
    left = lambda x_BxP: x_BxP[:, x_BxP.shape[1] - prompt_width :]
    right = lambda x_BxT: None if x_BxT is None else x_BxT[:, :completion_width]
    return self.replace(
        prompt_tokens_BxP=left(self.prompt_tokens_BxP),
        prompt_mask_BxP=left(self.prompt_mask_BxP),
        completion_tokens_BxT=right(self.completion_tokens_BxT),
        completion_mask_BxT=right(self.completion_mask_BxT),
        old_logp_BxT=right(self.old_logp_BxT),
        ref_logp_BxT=right(self.ref_logp_BxT),
        proximal_logp_BxT=right(self.proximal_logp_BxT),
        context_mask_BxT=right(self.context_mask_BxT),
    )


def bucket_width(longest: int, limit: int) -> int:
  """The learner's width for rows at most ``longest`` tokens long: the next
  of 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them), at most
  ``limit``. Padding stays under a third of the width beyond 4 tokens, and a
  run compiles its train step for a few widths only (about
  ``2 log2(limit / 4) + 1`` per dimension).

  Example:
    >>> [bucket_width(n, 100) for n in (1, 5, 7, 9, 13, 33, 97)]
    [4, 6, 8, 12, 16, 48, 100]
  """
  if not 0 <= longest <= limit:
    raise ValueError(f"longest={longest} must be in [0, limit={limit}]")
  width = 4
  while width < longest:
    width = width * 3 // 2 if width & (width - 1) == 0 else width * 4 // 3
  return min(width, limit)
