"""Policy-gradient losses as pure per-token functions, and DAPO's overlong
reward shaping.

Each loss takes the policy's and the sampler's log-probabilities of the
completion tokens, the mask and one advantage per sequence, all float32 with
padding already zeroed (:func:`logra_jax.rl.algo.loss_terms` cleans them),
and returns the per-token loss ``[B, T]`` (aggregated by ``loss_terms``) with
the metrics that debug it, as ``(sum, count)`` pairs that micro-batches
sum, or, for names ending in ``_min`` / ``_max``, ``(extreme, any)`` pairs
that micro-batches reduce with min / max (:func:`reduce_metrics`).

Shapes are spelled in the names: ``B`` sequences, ``T`` completion tokens,
``M`` micro-batches. With the token ratio
:math:`r_{t} = \\pi_\\theta(y_t) / \\pi_{old}(y_t)` and the sequence ratio
:math:`s = \\exp\\big(\\frac{1}{|y|}\\sum_t \\log r_t\\big)` (the geometric
mean of the token ratios):

* ``clip`` (PPO/GRPO): :math:`-\\min(r_t A, \\operatorname{clip}(r_t) A)`;
* ``gspo``: :math:`-\\min(s A, \\operatorname{clip}(s) A)` on every token of
  the sequence;
* ``gspo_token``: the same with :math:`s_t = \\mathrm{sg}(s)\\, \\pi_\\theta(y_t)
  / \\mathrm{sg}(\\pi_\\theta(y_t))`, whose value is :math:`s` and whose
  gradient is token by token;
* ``cispo``: :math:`-\\mathrm{sg}(\\operatorname{clip}(r_t))\\, A \\log
  \\pi_\\theta(y_t)` (or the sequence ratio's clip): no token's gradient is
  dropped;

where :math:`\\operatorname{clip}(x) = \\min(\\max(x, 1 - \\epsilon_{low}),
1 + \\epsilon_{high})`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Metrics = dict[str, tuple[Array, Array]]


def _token_sum(x_BxT: Array, mask_BxT: Array) -> tuple[Array, Array]:
  """``(sum over valid tokens, their count)`` of ``x``."""
  return (x_BxT.astype(jnp.float32) * mask_BxT).sum(), mask_BxT.sum()


def _extremes(name: str, x: Array, valid: Array) -> Metrics:
  """``{name_min: (min, any), name_max: (max, any)}`` over the valid
  entries; ``any`` is 1 when there is one, and the extremes of none are
  +-inf, which min / max over micro-batches ignore."""
  valid = valid.astype(bool)
  found = valid.any().astype(jnp.float32)
  return {
      f"{name}_min": (jnp.where(valid, x, jnp.inf).min(), found),
      f"{name}_max": (jnp.where(valid, x, -jnp.inf).max(), found),
  }


def _clip_metrics(
    prefix: str, low: Array, high: Array, count: Callable
) -> Metrics:
  """The clipped fractions (both sides, low, high) named ``prefix``."""
  return {
      f"{prefix}clip_fraction": count(low | high),
      f"{prefix}clip_low_fraction": count(low),
      f"{prefix}clip_high_fraction": count(high),
  }


def _ratio_metrics(
    ratio_BxT: Array, mask_BxT: Array, seq_ratio_B: Array
) -> Metrics:
  """Mean, min and max of the token ratios and of the sequence ratios
  (over the sequences with at least one valid token)."""
  has_B = mask_BxT.sum(axis=1) > 0
  seq = lambda x_B: ((x_B * has_B).sum(), has_B.sum().astype(jnp.float32))
  return {
      "ratio_mean": _token_sum(ratio_BxT, mask_BxT),
      **_extremes("ratio", ratio_BxT, mask_BxT),
      "seq_ratio_mean": seq(seq_ratio_B),
      **_extremes("seq_ratio", seq_ratio_B, has_B),
  }


def sequence_log_ratio(
    logp_BxT: Array, old_logp_BxT: Array, mask_BxT: Array
) -> Array:
  r"""The log of GSPO's sequence importance ratio: the mean log token ratio.

  .. math:: \log s = \frac{1}{|y|} \sum_{t \le |y|} (\log\pi_\theta(y_t)
     - \log\pi_{old}(y_t))

  Args:
    logp_BxT: policy log-probabilities, 0 at padding.
    old_logp_BxT: sampler log-probabilities, 0 at padding.
    mask_BxT: 1 on completion tokens (float32).

  Returns:
    ``[B]`` log sequence ratios (0 for a row without tokens).

  Example:
    >>> sequence_log_ratio(jnp.array([[-1., -2., 0.]]), jnp.zeros((1, 3)),
    ...                    jnp.array([[1., 1., 0.]]))
    Array([-1.5], dtype=float32)
  """
  tokens_B = mask_BxT.sum(axis=1)
  return ((logp_BxT - old_logp_BxT) * mask_BxT).sum(axis=1) / jnp.maximum(
      tokens_B, 1.0
  )


def clip_loss(
    logp_BxT: Array,
    old_logp_BxT: Array,
    mask_BxT: Array,
    adv_B: Array,
    eps_low: float,
    eps_high: float,
) -> tuple[Array, Metrics]:
  r"""PPO-style clipped loss per token (GRPO, DAPO's clip-higher).

  .. math:: \ell_t = -\min\big(r_t A,\ \operatorname{clip}(r_t, 1 -
     \epsilon_{low}, 1 + \epsilon_{high}) A\big)

  A token is counted clipped when the clip removes its gradient: ``r_t <
  1 - eps_low`` with ``A < 0`` (low) or ``r_t > 1 + eps_high`` with ``A > 0``
  (high).

  Args:
    logp_BxT: policy log-probabilities, 0 at padding.
    old_logp_BxT: sampler log-probabilities, 0 at padding.
    mask_BxT: 1 on completion tokens (float32).
    adv_B: one advantage per sequence.
    eps_low: the ratio's floor is ``1 - eps_low``.
    eps_high: the ratio's ceiling is ``1 + eps_high``.

  Returns:
    ``(loss_BxT, metrics)``: ``clip_fraction``, ``clip_low_fraction``,
    ``clip_high_fraction`` and ``ratio_mean`` over tokens.

  Example:
    >>> loss, _ = clip_loss(jnp.log(jnp.array([[1.5]])), jnp.zeros((1, 1)),
    ...                     jnp.ones((1, 1)), jnp.array([1.]), 0.2, 0.2)
    >>> loss   # -clip(1.5) * 1
    Array([[-1.2]], dtype=float32)
  """
  adv_Bx1 = adv_B[:, None]
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)
  loss_BxT = -jnp.minimum(ratio_BxT * adv_Bx1, clipped_BxT * adv_Bx1)
  low_BxT = (ratio_BxT < 1.0 - eps_low) & (adv_Bx1 < 0)
  high_BxT = (ratio_BxT > 1.0 + eps_high) & (adv_Bx1 > 0)
  count = lambda x_BxT: _token_sum(x_BxT, mask_BxT)
  metrics = _clip_metrics("", low_BxT, high_BxT, count)
  metrics["ratio_mean"] = count(ratio_BxT)
  return loss_BxT, metrics


def _gspo_metrics(
    logp_BxT, old_logp_BxT, mask_BxT, adv_B, seq_ratio_B, eps_low, eps_high
) -> Metrics:
  """Clipped fractions of sequences and of their tokens, and the ratios."""
  low_B = (seq_ratio_B < 1.0 - eps_low) & (adv_B < 0)
  high_B = (seq_ratio_B > 1.0 + eps_high) & (adv_B > 0)
  has_B = (mask_BxT.sum(axis=1) > 0).astype(jnp.float32)
  tokens = lambda x_B: _token_sum(
      jnp.broadcast_to(x_B[:, None], mask_BxT.shape), mask_BxT
  )
  seqs = lambda x_B: ((x_B * has_B).sum(), has_B.sum())
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  return {
      **_clip_metrics("", low_B, high_B, tokens),
      **_clip_metrics("seq_", low_B, high_B, seqs),
      **_ratio_metrics(ratio_BxT, mask_BxT, seq_ratio_B),
  }


def gspo_loss(
    logp_BxT: Array,
    old_logp_BxT: Array,
    mask_BxT: Array,
    adv_B: Array,
    eps_low: float,
    eps_high: float,
) -> tuple[Array, Metrics]:
  r"""GSPO: the sequence ratio, clipped per sequence, on each of its tokens.

  .. math:: \ell_t = -\min\big(s A,\ \operatorname{clip}(s, 1 -
     \epsilon_{low}, 1 + \epsilon_{high}) A\big), \qquad
     s = \exp\Big(\frac{1}{|y|}\sum_t \log\frac{\pi_\theta(y_t)}
     {\pi_{old}(y_t)}\Big)

  With ``seq-mean-token-mean`` aggregation this is the paper's
  :math:`\frac{1}{G}\sum_i \min(s_i A_i, \operatorname{clip}(s_i) A_i)`. A
  sequence is clipped when the clip removes its gradient (as for
  :func:`clip_loss`); its tokens are then all clipped.

  Args:
    logp_BxT: policy log-probabilities, 0 at padding.
    old_logp_BxT: sampler log-probabilities, 0 at padding.
    mask_BxT: 1 on completion tokens (float32).
    adv_B: one advantage per sequence.
    eps_low: the sequence ratio's floor is ``1 - eps_low`` (paper: 3e-4).
    eps_high: its ceiling is ``1 + eps_high`` (paper: 4e-4).

  Returns:
    ``(loss_BxT, metrics)``: clipped fractions of tokens (``clip_*``) and of
    sequences (``seq_clip_*``), and mean, min and max of the token
    (``ratio_*``) and sequence (``seq_ratio_*``) ratios.

  Example:
    >>> logp = jnp.log(jnp.array([[2., 0.5]]))   # s = sqrt(2 * 0.5) = 1
    >>> loss, _ = gspo_loss(logp, jnp.zeros((1, 2)), jnp.ones((1, 2)),
    ...                     jnp.array([1.]), 3e-4, 4e-4)
    >>> loss
    Array([[-1., -1.]], dtype=float32)

  References:
    Zheng et al., Group Sequence Policy Optimization, 2025 (arXiv
    2507.18071).
  """
  seq_ratio_B = jnp.exp(sequence_log_ratio(logp_BxT, old_logp_BxT, mask_BxT))
  clipped_B = jnp.clip(seq_ratio_B, 1.0 - eps_low, 1.0 + eps_high)
  loss_B = -jnp.minimum(seq_ratio_B * adv_B, clipped_B * adv_B)
  metrics = _gspo_metrics(
      logp_BxT,
      old_logp_BxT,
      mask_BxT,
      adv_B,
      jax.lax.stop_gradient(seq_ratio_B),
      eps_low,
      eps_high,
  )
  return jnp.broadcast_to(loss_B[:, None], logp_BxT.shape), metrics


def gspo_token_loss(
    logp_BxT: Array,
    old_logp_BxT: Array,
    mask_BxT: Array,
    adv_B: Array,
    eps_low: float,
    eps_high: float,
) -> tuple[Array, Metrics]:
  r"""GSPO-token: GSPO's sequence ratio with a gradient per token.

  .. math:: \ell_t = -\min\big(s_t A,\ \operatorname{clip}(s_t, 1 -
     \epsilon_{low}, 1 + \epsilon_{high}) A\big), \qquad
     s_t = \mathrm{sg}(s)\, \frac{\pi_\theta(y_t)}{\mathrm{sg}(\pi_\theta(y_t))}

  :math:`s_t` equals :math:`s` in value, so the clip decides per sequence;
  its gradient is :math:`s \nabla \log \pi_\theta(y_t)`. With one advantage
  per sequence (as here) value and gradient equal :func:`gspo_loss`'s, for
  every aggregation; the form exists for per-token advantages.

  Args:
    logp_BxT: policy log-probabilities, 0 at padding.
    old_logp_BxT: sampler log-probabilities, 0 at padding.
    mask_BxT: 1 on completion tokens (float32).
    adv_B: one advantage per sequence.
    eps_low: the ratio's floor is ``1 - eps_low``.
    eps_high: its ceiling is ``1 + eps_high``.

  Returns:
    ``(loss_BxT, metrics)``, the metrics of :func:`gspo_loss`.

  Example:
    >>> logp = jnp.log(jnp.array([[2., 0.5]]))
    >>> loss, _ = gspo_token_loss(logp, jnp.zeros((1, 2)), jnp.ones((1, 2)),
    ...                           jnp.array([1.]), 3e-4, 4e-4)
    >>> loss
    Array([[-1., -1.]], dtype=float32)

  References:
    Zheng et al., Group Sequence Policy Optimization, 2025 (arXiv
    2507.18071), section 4.3.
  """
  seq_ratio_B = jnp.exp(
      jax.lax.stop_gradient(
          sequence_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
      )
  )
  ratio_BxT = seq_ratio_B[:, None] * jnp.exp(
      logp_BxT - jax.lax.stop_gradient(logp_BxT)
  )
  adv_Bx1 = adv_B[:, None]
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)
  loss_BxT = -jnp.minimum(ratio_BxT * adv_Bx1, clipped_BxT * adv_Bx1)
  metrics = _gspo_metrics(
      logp_BxT, old_logp_BxT, mask_BxT, adv_B, seq_ratio_B, eps_low, eps_high
  )
  return loss_BxT, metrics


def cispo_loss(
    logp_BxT: Array,
    old_logp_BxT: Array,
    mask_BxT: Array,
    adv_B: Array,
    eps_low: float,
    eps_high: float,
    importance_level: str = "token",
) -> tuple[Array, Metrics]:
  r"""CISPO: REINFORCE weighted by the clipped, stop-gradiented ratio.

  .. math:: \ell_t = -\mathrm{sg}\big(\operatorname{clip}(r_t, 1 -
     \epsilon_{low}, 1 + \epsilon_{high})\big)\, A\, \log\pi_\theta(y_t)

  (with ``importance_level="sequence"``, :math:`s` in place of
  :math:`r_t`). The clip bounds the weight but keeps every token's gradient
  :math:`-\operatorname{clip}(r_t) A \nabla\log\pi_\theta(y_t)`; a token is
  counted clipped when its weight is cut (``r_t < 1 - eps_low``: low,
  ``r_t > 1 + eps_high``: high), whatever the advantage's sign. The paper
  sets no lower bound (``eps_low`` near 1) and tunes ``eps_high``.

  Args:
    logp_BxT: policy log-probabilities, 0 at padding.
    old_logp_BxT: sampler log-probabilities, 0 at padding.
    mask_BxT: 1 on completion tokens (float32).
    adv_B: one advantage per sequence.
    eps_low: the weight's floor is ``1 - eps_low``.
    eps_high: its ceiling is ``1 + eps_high``.
    importance_level: ``"token"`` (the paper's) or ``"sequence"`` (GSPO's
      ratio as the weight).

  Returns:
    ``(loss_BxT, metrics)``: the clipped fractions of tokens (and of
    sequences, ``seq_clip_*``, at the sequence level), and mean, min and
    max of the token and sequence ratios.

  Example:
    >>> loss, _ = cispo_loss(jnp.log(jnp.array([[2.]])), jnp.zeros((1, 1)),
    ...                      jnp.ones((1, 1)), jnp.array([1.]), 0.2, 0.28)
    >>> loss.round(4)   # -1.28 * 1 * log 2
    Array([[-0.8872]], dtype=float32)

  References:
    MiniMax, MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention, 2025 (arXiv 2506.13585), section 3.1.
  """
  ratio_BxT = jax.lax.stop_gradient(jnp.exp(logp_BxT - old_logp_BxT))
  seq_ratio_B = jax.lax.stop_gradient(
      jnp.exp(sequence_log_ratio(logp_BxT, old_logp_BxT, mask_BxT))
  )
  sequence = importance_level == "sequence"
  weight_BxT = (
      jnp.broadcast_to(seq_ratio_B[:, None], ratio_BxT.shape)
      if sequence
      else ratio_BxT
  )
  clipped_BxT = jnp.clip(weight_BxT, 1.0 - eps_low, 1.0 + eps_high)
  loss_BxT = -clipped_BxT * adv_B[:, None] * logp_BxT
  count = lambda x_BxT: _token_sum(x_BxT, mask_BxT)
  metrics = _clip_metrics(
      "", weight_BxT < 1.0 - eps_low, weight_BxT > 1.0 + eps_high, count
  )
  if sequence:
    has_B = (mask_BxT.sum(axis=1) > 0).astype(jnp.float32)
    seqs = lambda x_B: ((x_B * has_B).sum(), has_B.sum())
    metrics.update(
        _clip_metrics(
            "seq_",
            seq_ratio_B < 1.0 - eps_low,
            seq_ratio_B > 1.0 + eps_high,
            seqs,
        )
    )
  metrics.update(_ratio_metrics(ratio_BxT, mask_BxT, seq_ratio_B))
  return loss_BxT, metrics


def rollout_weights(
    proximal_logp_BxT: Array,
    rollout_logp_BxT: Array,
    mask_BxT: Array,
    correction: str,
    cap: float,
) -> tuple[Array, Metrics]:
  r"""Importance weights of the sampler-to-learner mismatch, truncated
  (``"tis"``) or masked (``"mis"``), per token.

  With the learner's proximal log-probs :math:`p_t` and the sampler's
  :math:`q_t` of the same sampled token,

  .. math:: w_t = \exp(p_t - q_t), \qquad
     \text{tis: } \min(w_t, C), \qquad
     \text{mis: } w_t\,[w_t \le C]

  (TRL's ``token_truncate`` and ``token_mask`` modes of
  ``vllm_importance_sampling_correction``; verl's token-level rollout IS
  weight, and its token-level rejection mask with the upper bound only:
  verl also drops tokens below ``1 / C`` by default, here no weight below
  the cap is dropped). A token masked by ``"mis"`` keeps its place in the
  aggregation's count, as in TRL (verl's rejection also removes it there).
  :func:`logra_jax.rl.algo.loss_terms` multiplies each token's policy loss
  by the weight (its ratio then taken to the proximal log-probs).

  Args:
    proximal_logp_BxT: the learner's log-probs, 0 at padding.
    rollout_logp_BxT: the sampler's log-probs, 0 at padding.
    mask_BxT: 1 on completion tokens (float32).
    correction: ``"tis"`` or ``"mis"``.
    cap: :math:`C > 0`.

  Returns:
    ``(weight_BxT, metrics)``: the weights under ``stop_gradient`` (1 at
    padding), ``rollout/is_weight_mean`` (of the weights applied) and
    ``rollout/is_truncated_fraction`` (of the tokens with :math:`w_t > C`:
    cut to ``C`` by ``"tis"``, dropped by ``"mis"``).

  References:
    Yao et al., Your efficient RL framework secretly brings you off-policy
    RL training, 2025 (fengyao.notion.site/off-policy-rl): truncated IS.
    Liu et al., When speed kills stability: demystifying RL collapse from
    the training-inference mismatch, 2025 (richardli.xyz/rl-collapse):
    masked IS.

  Example:
    >>> w, _ = rollout_weights(jnp.log(jnp.array([[3., 1., 1.]])),
    ...                        jnp.zeros((1, 3)), jnp.ones((1, 3)), "tis", 2.)
    >>> w
    Array([[2., 1., 1.]], dtype=float32)
  """
  weight_BxT = jnp.exp(
      jax.lax.stop_gradient(proximal_logp_BxT - rollout_logp_BxT)
  )
  over_BxT = weight_BxT > cap
  if correction == "tis":
    weight_BxT = jnp.minimum(weight_BxT, cap)
  elif correction == "mis":
    weight_BxT = jnp.where(over_BxT, 0.0, weight_BxT)
  else:
    raise ValueError(
        f"unknown rollout correction {correction!r}; valid: 'tis', 'mis'"
    )
  return weight_BxT, {
      "rollout/is_weight_mean": _token_sum(weight_BxT, mask_BxT),
      "rollout/is_truncated_fraction": _token_sum(over_BxT, mask_BxT),
  }


POLICY_LOSSES: dict[str, Callable[..., tuple[Array, Metrics]]] = {
    "clip": clip_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "cispo": cispo_loss,
}


def reduce_metrics(metrics_M: Metrics) -> Metrics:
  """Combines metrics stacked over micro-batches (leading axis ``M``):
  ``(sum, count)`` pairs are summed, ``(extreme, any)`` pairs of names
  ending in ``_min`` / ``_max`` take the min / max and the any.

  Example:
    >>> reduce_metrics({"a": (jnp.array([1., 2.]), jnp.array([2., 2.])),
    ...                 "r_min": (jnp.array([.5, jnp.inf]), jnp.array([1., 0.]))})
    {'a': (Array(3., dtype=float32), Array(4., dtype=float32)), \
'r_min': (Array(0.5, dtype=float32), Array(1., dtype=float32))}
  """
  out = {}
  for name, (value_M, count_M) in metrics_M.items():
    if name.endswith("_min"):
      out[name] = (value_M.min(axis=0), count_M.max(axis=0))
    elif name.endswith("_max"):
      out[name] = (value_M.max(axis=0), count_M.max(axis=0))
    else:
      out[name] = (value_M.sum(axis=0), count_M.sum(axis=0))
  return out


# ------------------------------------------------------------------------------------------
# Overlong reward shaping (DAPO).
# ------------------------------------------------------------------------------------------


def overlong_penalty(
    lengths_N: np.ndarray, max_new_tokens: int, buffer: int, penalty: float
) -> np.ndarray:
  r"""DAPO's soft overlong punishment, added to each completion's reward.

  With :math:`L_{max}` = ``max_new_tokens`` and :math:`L_{c}` = ``buffer``:

  .. math:: R_{len}(L) = \begin{cases} 0 & L \le L_{max} - L_c \\
     -\frac{L - (L_{max} - L_c)}{L_c}\, p & L_{max} - L_c < L \le L_{max}
     \end{cases}

  so the penalty grows linearly to ``-penalty`` at the budget.

  Args:
    lengths_N: completion lengths in tokens (at most ``max_new_tokens``).
    max_new_tokens: the generation budget.
    buffer: the last tokens of the budget that are penalized (``0 <= buffer
      < max_new_tokens``; 0: no penalty).
    penalty: the penalty at ``max_new_tokens``, :math:`p`.

  Returns:
    ``[N]`` float32 penalties (each ``<= 0``).

  Example:
    >>> overlong_penalty(np.array([4, 6, 7, 8]), 8, 4, 1.0)
    array([ 0.  , -0.5 , -0.75, -1.  ], dtype=float32)

  References:
    Yu et al., DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale, 2025 (arXiv 2503.14476), equation 13.
  """
  if not 0 <= buffer < max_new_tokens:
    raise ValueError(
        f"overlong buffer={buffer} must be in [0, max_new_tokens="
        f"{max_new_tokens})"
    )
  lengths_N = np.asarray(lengths_N, np.float32)
  if buffer == 0:
    return np.zeros_like(lengths_N)
  excess_N = np.maximum(lengths_N - (max_new_tokens - buffer), 0.0)
  # 0 - x, not -x: no -0.0 inside the buffer's free part.
  return (0.0 - excess_N / buffer * penalty).astype(np.float32)


def truncated(
    tokens_NxT: np.ndarray,
    lengths_N: np.ndarray,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
) -> np.ndarray:
  """Which completions were cut by the budget: ``max_new_tokens`` long,
  the last one not a stop token (generation ends after a stop token).

  Example:
    >>> truncated(np.array([[5, 2, 0], [5, 5, 5], [5, 5, 2]]),
    ...           np.array([2, 3, 3]), 3, (2,))
    array([False,  True, False])
  """
  lengths_N = np.asarray(lengths_N)
  last_N = np.take_along_axis(
      np.asarray(tokens_NxT), np.maximum(lengths_N - 1, 0)[:, None], axis=1
  )[:, 0]
  return (lengths_N >= max_new_tokens) & ~np.isin(last_N, list(stop_ids))
