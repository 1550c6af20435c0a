"""How much of each RL gradient a rank-r projector keeps: why rank 8 and
projecting the embedding table cost accuracy in the parity study.

LoGRA moves each projected matrix only inside its projector's span, so the
part of a gradient ``G`` outside that span is lost to the step. This
follows a parity setting's tuned dense-Adam run (its starting policy,
task, batch and learning rate, as the study's ``adam`` runs train; prompts
drawn uniformly from the training split) and, at every step, measures for each weight matrix the
fraction of the gradient's squared Frobenius norm that a rank-r projector
on the matrix's longer side keeps, for r in ``--ranks``:

  fresh   the top-r singular subspace of this step's own gradient: what a
          projector refreshed on this step keeps, the most any rank-r
          projector can, :math:`\\sum_{i<r} \\sigma_i^2 / \\sum_i \\sigma_i^2`;
  stale   the top-r subspace of the gradient at its window's first step
          (refreshed every w steps, as LoGRA's range projector is every
          ``optimizer.refresh_every``), applied to this step's gradient,
          :math:`\\|P^\\top G\\|_F^2 / \\|G\\|_F^2`, for each window w
          of ``--windows`` (default: 10, the parity study's
          ``logra-rank8-refresh10``, and the setting's own);
  summed  the same projector applied to the sum of the window's later
          gradients, :math:`\\|P^\\top \\sum_t G_t\\|_F^2 / \\|\\sum_t G_t\\|_F^2`,
          one value per window: a step's gradient is partly batch noise,
          which Adam's moments average out, so what a projector must keep
          is the direction the steps share (this one's low where the
          gradients' common direction leaves the projector's span);
  random  a random projector's expected fraction, ``r / L`` for the longer
          side's length ``L``.

Matrices are grouped as the study's levers treat them: ``embedding`` (the
embedding table and LM head: dense in LoGRA's default, projected in
``logra-projected``), ``attention`` (q, k, v, o) and ``mlp`` (gate, up,
down), one matrix per layer; a group's fraction is its matrices' kept
energy over their total energy (so large gradients weigh more), averaged
over the steps with a gradient (stale: those after its window's first;
summed: over windows).

The gradients are those of the study's loss along Adam's path (the policy
Adam moves, not LoGRA's): a measurement of the gradients themselves, no
accuracy claim.

``--quick``: the smoke policy for 3 steps (outputs well formed only).

Writes ``gradient_spectrum.md`` and ``.json`` to
``experiments/results/gradient_spectrum/<setting>/`` (``--results``).

Run: python experiments/gradient_spectrum.py [--setting tiny] [--steps 100]
     [--ranks 8 16 32] [--windows 10 50] [--quick]
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax

import parity
import parity_design
import provenance
import study
from logra_jax import policy_state
from logra_jax.optim import non_finite
from logra_jax.rl import learner

GROUPS = {
    "embedding": ("embed", "lm_head"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def group_of(path) -> str | None:
  """The group of a parameter's path (None: a vector, norm or bias)."""
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  for group, members in GROUPS.items():
    if any(name in members for name in names):
      return group
  return None


def matrices(grads) -> dict[str, list[np.ndarray]]:
  """Each group's gradient matrices on the host, oriented ``[L, S]`` with
  the longer side first (the side LoGRA's projector spans), one per layer
  of a stacked ``[layers, m, n]`` weight."""
  found = {group: [] for group in GROUPS}
  for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
    group = group_of(path)
    if group is None or leaf.ndim < 2:
      continue
    leaf = np.asarray(leaf, np.float64)
    for matrix in leaf.reshape((-1, *leaf.shape[-2:])):
      found[group].append(
          matrix if matrix.shape[0] >= matrix.shape[1] else matrix.T
      )
  return found


class Tally:
  """Each step's kept fractions per group: ``fresh@r``, ``random@r`` and,
  per projector window ``w``, ``stale{w}@r`` (with ``refresh{w}``: the
  window's projectors were taken at this step); and per window of ``w``
  steps, ``summed{w}@r``: the fraction of the sum of its later steps'
  gradients (what a first moment accumulates, batch noise averaged out)
  its projector keeps."""

  def __init__(self, ranks: list[int], windows: list[int]):
    self.ranks = ranks
    self.windows = windows
    # window -> group -> per matrix, rank -> projector
    self.projectors: dict[int, dict[str, list[dict[int, np.ndarray]]]] = {
        w: {} for w in windows
    }
    # window -> group -> per matrix, the sum of the window's later gradients
    self.sums: dict[int, dict[str, list[np.ndarray]]] = {w: {} for w in windows}
    # (window, group) -> each finished window's summed fractions
    self.finished: dict[tuple[int, str], list[dict[str, float]]] = {}
    self.steps: list[dict] = []

  def add(self, step: int, grads) -> None:
    """One step's gradients: its fractions, and at a window's first step
    the projectors the rest of the window is measured with. A group whose
    gradient is zero this step (every group of completions scored alike)
    has no fractions; if a window starts there, its projectors are taken
    at the next step with a gradient."""
    for w in self.windows:
      if step % w == 0:
        self._finish(w)
    fractions = {}
    for group, found in matrices(grads).items():
      energies = [float(np.sum(m**2)) for m in found]
      if found and sum(energies) > 0:
        fractions[group] = self._fractions(group, found, energies)
    self.steps.append({"step": step, **fractions})

  def _finish(self, w: int) -> None:
    """Ends window ``w``: records its summed fractions, forgets its
    projectors and sums."""
    for group in self.sums[w]:
      kept = self._summed(w, group)
      if kept is not None:
        self.finished.setdefault((w, group), []).append(kept)
    self.projectors[w].clear()
    self.sums[w].clear()

  def _summed(self, w: int, group: str) -> dict[str, float] | None:
    """The open window's summed fractions (None: nothing summed yet)."""
    sums = self.sums[w].get(group, [])
    total = sum(float(np.sum(m**2)) for m in sums)
    if total == 0:
      return None
    return {
        f"summed{w}@{r}": sum(
            float(np.sum((p[r].T @ m) ** 2))
            for p, m in zip(self.projectors[w][group], sums)
        )
        / total
        for r in self.ranks
    }

  def _fractions(self, group, found, energies) -> dict[str, float]:
    """One group's kept energy over its total, per kind and rank."""
    refreshed = {w: group not in self.projectors[w] for w in self.windows}
    # One SVD per matrix: its singular values, and where a window starts
    # here, its top singular vectors.
    if any(refreshed.values()):
      svds = [np.linalg.svd(m, full_matrices=False)[:2] for m in found]
      tops = [u[:, : max(self.ranks)].copy() for u, _ in svds]
      sigmas = [sigma for _, sigma in svds]
    else:
      sigmas = [np.linalg.svd(m, compute_uv=False) for m in found]
    for w in self.windows:
      if refreshed[w]:
        self.projectors[w][group] = [
            {r: top[:, :r] for r in self.ranks} for top in tops
        ]
      else:
        sums = self.sums[w].setdefault(group, [0.0] * len(found))
        self.sums[w][group] = [a + m for a, m in zip(sums, found)]
    kept = {}
    for i, (matrix, energy) in enumerate(zip(found, energies)):
      sigma2 = sigmas[i] ** 2
      for r in self.ranks:
        parts = {
            "fresh": float(np.sum(sigma2[:r])),
            "random": energy * min(r, len(matrix)) / len(matrix),
            **{
                f"stale{w}": float(
                    np.sum((self.projectors[w][group][i][r].T @ matrix) ** 2)
                )
                for w in self.windows
            },
        }
        for kind, value in parts.items():
          kept[f"{kind}@{r}"] = kept.get(f"{kind}@{r}", 0.0) + value
    total = sum(energies)
    return {
        **{key: value / total for key, value in kept.items()},
        **{f"refresh{w}": refreshed[w] for w in self.windows},
    }

  def kinds(self) -> list[str]:
    """The kinds of fraction, in the report's order."""
    return [
        "fresh",
        *(f"stale{w}" for w in self.windows),
        *(f"summed{w}" for w in self.windows),
        "random",
    ]

  def summary(self) -> dict[str, dict[str, float]]:
    """Each group's mean fraction per kind and rank over the steps with a
    gradient (a window's stale fraction: over those after its first;
    summed: over its windows, the open one too), and their count."""
    out = {}
    for group in GROUPS:
      rows = [s[group] for s in self.steps if group in s]
      if not rows:
        continue
      out[group] = {"steps": len(rows)}
      for w in self.windows:
        used = [f for f in rows if not f[f"refresh{w}"]]
        windows = self.finished.get((w, group), []) + [
            k for k in [self._summed(w, group)] if k is not None
        ]
        for r in self.ranks:
          out[group][f"stale{w}@{r}"] = _mean(f[f"stale{w}@{r}"] for f in used)
          out[group][f"summed{w}@{r}"] = _mean(
              k[f"summed{w}@{r}"] for k in windows
          )
      for kind in ("fresh", "random"):
        for r in self.ranks:
          out[group][f"{kind}@{r}"] = _mean(f[f"{kind}@{r}"] for f in rows)
    return out


def _mean(values) -> float:
  """The mean, NaN of nothing."""
  values = list(values)
  return float(np.mean(values)) if values else float("nan")


def tapped_optimizer(config, params, tally_step):
  """The study's optimizer for ``config`` with a tap before it that hands
  each step's gradients to ``tally_step`` on the host."""

  def update(grads, state, params=None, **extra):
    jax.debug.callback(tally_step, grads)
    return grads, state

  tap = optax.GradientTransformationExtraArgs(
      lambda params: optax.EmptyState(), update
  )
  # The train step takes only a guarded optimizer's state at the top, so the
  # chain (whose second stage is the study's guarded optimizer) is guarded too.
  return non_finite.skip_non_finite(
      optax.chain(tap, policy_state.make_optimizer(config.optimizer, params))
  )


def follow(args, config) -> Tally:
  """Tuned Adam's run of the setting for ``--steps`` steps, every step's
  gradients tallied."""
  policy, sample = study.sampler(config)
  tally = Tally(args.ranks, windows(args, config))
  step_now = [0]
  tx = tapped_optimizer(
      config, policy.params, lambda g: tally.add(step_now[0], g)
  )
  params, opt_state = policy_state.init_train_state(
      config.optimizer, tx, policy.params
  )
  train_step = learner.make_train_step(policy.graphdef, tx, config)
  for step in range(args.steps):
    step_now[0] = step
    batch, metrics = sample(params, step)
    params, opt_state, _ = train_step(params, opt_state, batch)
    jax.effects_barrier()
    if step % 10 == 0 or step == args.steps - 1:
      print(f"step {step}: reward {metrics['reward/total']:.3f}", flush=True)
  return tally


def windows(args, config) -> list[int]:
  """The projector windows measured: ``--windows``, else the setting's
  ``optimizer.refresh_every`` and the parity study's follow-up window (10)."""
  return sorted(set(args.windows or [10, config.optimizer.refresh_every]))


def report(args, tally: Tally, summary: dict, record: dict) -> str:
  """The markdown table of ``summary`` (:meth:`Tally.summary`): per group
  and rank, the kept fraction of each kind."""
  kinds = tally.kinds()
  names = {
      "fresh": "fresh",
      "random": "random",
      **{f"stale{w}": f"stale, {w}-step window" for w in tally.windows},
      **{f"summed{w}": f"summed, {w}-step window" for w in tally.windows},
  }
  lines = [
      "Fraction of the RL gradient's squared norm a rank-r projector keeps "
      f"(setting {args.setting}, along tuned dense Adam's path, "
      f"{args.steps} steps; mean over the steps with a gradient; fresh: "
      "each step's own top-r subspace; stale: the projector of its "
      "window's first step, on the window's later steps; summed: that "
      "projector on the sum of the window's later gradients; random: a "
      "random rank-r projector).",
      "",
      "| group | rank | steps | " + " | ".join(names[k] for k in kinds) + " |",
      "|---|---:|---:|" + "---:|" * len(kinds),
  ]
  for group, values in summary.items():
    for r in args.ranks:
      lines.append(
          f"| {group} | {r} | {values['steps']} | "
          + " | ".join(f"{values[f'{k}@{r}']:.3f}" for k in kinds)
          + " |"
      )
  return "\n".join(lines + ["", provenance.footer(record)]) + "\n"


def parse_args():
  """The flags, checked before anything runs (exit 2)."""
  parser = study.parser(
      __doc__.splitlines()[0], "gradient_spectrum", runs=False
  )
  parser.add_argument(
      "--setting",
      default="tiny",
      help=f"a parity setting of {sorted(parity_design.SETTINGS)}",
  )
  parser.add_argument(
      "--steps", type=int, help="steps followed (100; 3 --quick)"
  )
  parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
  parser.add_argument(
      "--windows",
      type=int,
      nargs="+",
      help="projector windows in steps (default: 10 and the setting's "
      "optimizer.refresh_every)",
  )
  parser.add_argument(
      "--learning-rate",
      type=float,
      help="Adam's rate (default: the rate the study chose for the setting)",
  )
  args = study.parse(parser)
  study.check_names(parser, "setting", [args.setting], parity_design.SETTINGS)
  if args.steps is None:
    args.steps = 3 if args.quick else 100
  if args.steps < 1:
    study.fail(f"--steps must be >= 1, got {args.steps}")
  for flag in ("ranks", "windows"):
    values = getattr(args, flag) or [1]
    if min(values) < 1:
      study.fail(f"--{flag} must all be >= 1, got {values}")
  study.check_positive("learning-rate", args.learning_rate)
  return args


def chosen_rate(args) -> float:
  """``--learning-rate``, else the rate the parity study's sweep chose for
  tuned Adam on the setting (:func:`parity.tuned_rate`), else the grid's
  middle where the sweep is not complete."""
  if args.learning_rate is not None:
    return args.learning_rate
  tuned = parity.tuned_rate(args, args.setting, "adam")
  if tuned is not None:
    return tuned
  rates = parity_design.grid(
      args, "adam", parity_design.setting_of(args, args.setting)
  )
  return rates[len(rates) // 2]


def main() -> None:
  args = parse_args()
  shared = parity.helper_args(args)
  rate = chosen_rate(shared)
  results = study.results_folder(args, f"gradient_spectrum/{args.setting}")
  record = study.provenance_record(args)
  parity.prepare(shared, [args.setting], record)
  config = study.run_config(
      args,
      parity.run_overrides(shared, args.setting, "adam", rate, 0, kl=False)
      + [f"steps={args.steps}"],
      parity_design.setting_of(args, args.setting).preset,
  )
  print(f"{args.setting}: dense Adam at {rate:g}", flush=True)
  tally = follow(args, config)
  summary = tally.summary()
  table = report(args, tally, summary, record)
  (results / "gradient_spectrum.json").write_text(
      json.dumps(
          {
              "provenance": record,
              "setting": args.setting,
              "learning_rate": rate,
              "windows": tally.windows,
              "summary": summary,
              "steps": tally.steps,
          },
          indent=1,
      )
      + "\n"
  )
  (results / "gradient_spectrum.md").write_text(table)
  study.write_provenance(record, results)
  print(table, flush=True)


if __name__ == "__main__":
  main()
