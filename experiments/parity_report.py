"""The parity study's report: tables with confidence intervals and tests,
the held-out curves' panels and the learning-rate sweep's plot."""

from __future__ import annotations

import math
import statistics

import parity_design
import provenance
import study
import stats


def _values(rows, name, arm, column="test_after") -> list[float]:
  """A column's values over the runs of one setting and arm."""
  return [r[column] for r in rows if r["setting"] == name and r["arm"] == arm]


def report(args, rows, chosen, record) -> str:
  """The markdown: per setting, the arms' test accuracy with CIs and the
  tests of :data:`parity_design.COMPARISONS` (each LoGRA arm against the
  tuned baselines, logra-small-sync and its levers against logra, each
  follow-up against its lever and logra) among the arms run."""
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
    setting = parity_design.setting_of(args, name)
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
  """The markdown rows of ``name``'s tests
  (:data:`parity_design.COMPARISONS`, tuned then KL-matched, among the arms
  run): each difference with its 95% CI, the verdict of its own test, and
  its non-inferiority p-value adjusted (Holm) over every test of the table
  that has one; then the :data:`parity_design.PRIMARY` tests adjusted over
  themselves."""
  pairs, compared = [], []
  for kl in ("", "+kl"):
    for arm, base in parity_design.COMPARISONS:
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
      if not pair[2] and pair[:2] in parity_design.PRIMARY
  ]
  if primary:
    holm_p = stats.holm([c.non_inferiority_p for _, c in primary])
    lines += [
        "",
        f"The primary tests (each of {', '.join(parity_design.LOGRA_ARMS)} against each "
        f"tuned baseline of {', '.join(parity_design.BASELINES)}; "
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
  levers = [a for a in args.arms if a not in parity_design.MAIN_ARMS]
  groups = [("", [a for a in args.arms if a in parity_design.MAIN_ARMS])]
  if levers:
    reference = ["logra"] if "logra" in args.arms else []
    groups.append((": levers", reference + levers))
  groups.append(("+kl", [a + "+kl" for a in parity_design.kl_arms(args)]))
  panels = []
  for name in args.settings:
    for title, arms in groups:
      curves = {a: of(name, a) for a in arms}
      if curves and all(curves.values()):  # none under --kl-seeds 0
        panels.append((f"{name}{title}", curves))
  return panels
