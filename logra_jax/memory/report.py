"""What the planner reports: per-device bytes of one train step."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from logra_jax import configs
from logra_jax import parallel

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  r"""Per-device bytes of one train step (and an optional rollout reservation).

  ``params`` and ``optimizer_state`` are the step's resident inputs;
  ``grads`` the gradient it materializes (full, or the sketches in
  sketch-direct mode); ``temporaries`` everything
  else XLA allocates during the step (activations, workspace);
  ``reference`` the frozen reference policy's weights of a KL penalty;
  ``rollout`` a colocated rollout engine's reservation. With
  ``rollout_between_steps`` (the zero-copy engine: it samples with the
  learner's arrays between train steps, ``rollout.max_staleness=0``) the
  sampling program and the train step are never live together, so

  .. math::
    total = params + optimizer\_state + reference
            + \max(batch + grads + temporaries + outputs,\ rollout),

  the larger of the two phases over the resident state (the batch is the
  rollout's output, counted in ``rollout`` while it samples). Otherwise (an
  engine with its own copy sampling beside the step, or none) the parts add
  up: ``total = params + optimizer_state + batch + grads + temporaries +
  outputs not aliased to inputs + reference + rollout``.

  ``compiled_for`` names the platform XLA compiled the programs for
  (``"cpu"`` when the planner ran without the accelerators): a compile for
  another platform lays memory out differently, and a CPU plan of a GPU run
  can fall short (measured: docs/planner.md, "The whole system on one
  device").

  Example:
    >>> report = MemoryReport(
    ...     params=GIB, grads=GIB, optimizer_state=2 * GIB, batch=0,
    ...     temporaries=GIB, outputs=0, reference=0, rollout=0,
    ...     total=5 * GIB, device_memory=8 * GIB, num_params=2**28,
    ...     description="example")
    >>> report.fits, report.summary().splitlines()[-1]
    (True, 'fits in 8 GiB: yes (3.00 GiB free)')
  """

  params: int
  grads: int
  optimizer_state: int
  batch: int
  temporaries: int
  outputs: int
  reference: int
  rollout: int
  total: int
  device_memory: Optional[int]
  num_params: int
  description: str
  rollout_between_steps: bool = False
  compiled_for: str = ""

  @property
  def fits(self) -> Optional[bool]:
    """Whether the total fits in the device memory (None: not given)."""
    return (
        None
        if self.device_memory is None
        else (self.total <= self.device_memory)
    )

  @property
  def step_phase(self) -> int:
    """Bytes live only while the train step runs: its batch, gradients,
    temporaries and outputs."""
    return self.batch + self.grads + self.temporaries + self.outputs

  @property
  def train_total(self) -> int:
    """The train step's own peak, without the rollout reservation: the
    resident state (weights, optimizer state, reference) plus
    :attr:`step_phase`."""
    return (
        self.total
        - peak_of_phases(
            self.step_phase, self.rollout, self.rollout_between_steps
        )
        + self.step_phase
    )

  def with_rollout(
      self, rollout: int, between_steps: bool = True
  ) -> MemoryReport:
    """This train step's plan with another rollout reservation (e.g. one
    compiled once for several step shapes) and its total by the same phase
    rule: ``between_steps``, the larger phase; otherwise their sum.

    Example:
      >>> step = MemoryReport(
      ...     params=4, grads=1, optimizer_state=2, batch=1, temporaries=2,
      ...     outputs=0, reference=0, rollout=0, total=10,
      ...     device_memory=None, num_params=1, description="example")
      >>> step.with_rollout(3).total, step.with_rollout(5).total
      (10, 11)
      >>> step.with_rollout(3, between_steps=False).total
      13
    """
    total = self.train_total - self.step_phase
    return dataclasses.replace(
        self,
        rollout=rollout,
        rollout_between_steps=between_steps,
        total=total + peak_of_phases(self.step_phase, rollout, between_steps),
    )

  def to_dict(self) -> dict[str, Any]:
    """The report as a JSON-serializable dict (bytes per device)."""
    return {
        "params": self.params,
        "grads": self.grads,
        "optimizer_state": self.optimizer_state,
        "temporaries": self.temporaries,
        "reference": self.reference,
        "rollout": self.rollout,
        "total": self.total,
        "fits": self.fits,
        "batch": self.batch,
        "outputs": self.outputs,
        "rollout_between_steps": self.rollout_between_steps,
        "device_memory": self.device_memory,
        "num_params": self.num_params,
        "description": self.description,
        "compiled_for": self.compiled_for,
    }

  def summary(self) -> str:
    """The report as a table in GiB per device, for the console."""
    rows = [
        ("parameters", self.params),
        ("gradients", self.grads),
        ("optimizer state", self.optimizer_state),
        ("batch", self.batch),
        ("temporaries", self.temporaries),
        ("outputs (not aliased)", self.outputs),
        ("reference policy", self.reference),
        ("rollout reservation", self.rollout),
        (
            "total (peak phase)" if self.rollout_between_steps else "total",
            self.total,
        ),
    ]
    lines = [self.description, "per device:"]
    lines += [f"  {name:<22} {value / GIB:9.2f} GiB" for name, value in rows]
    if self.rollout_between_steps:
      lines.append(
          "  (the rollout samples between train steps: the total holds the "
          "larger of the two phases)"
      )
    if self.compiled_for == "cpu":
      lines.append(
          "  (compiled for CPU: an accelerator's compile lays memory out "
          "otherwise; plan on the accelerator to be exact, docs/planner.md)"
      )
    if self.device_memory is not None:
      margin = (self.device_memory - self.total) / GIB
      lines.append(
          f"fits in {self.device_memory / GIB:.0f} GiB: "
          + (
              f"yes ({margin:.2f} GiB free)"
              if self.fits
              else f"NO, over by {-margin:.2f} GiB"
          )
      )
    return "\n".join(lines)


def peak_of_phases(step: int, rollout: int, between_steps: bool) -> int:
  """Peak bytes of the train step's phase and a rollout reservation: the
  larger when the engine samples between steps, else their sum.

  Example:
    >>> peak_of_phases(3, 5, True), peak_of_phases(3, 5, False)
    (5, 8)
  """
  return max(step, rollout) if between_steps else step + rollout


def describe(
    name: str,
    num_params: int,
    mesh: parallel.MeshConfig,
    opt: configs.OptimizerConfig,
    reference_dtype: Optional[str],
    workload: str,
) -> str:
  """The plan's first line: model, mesh, optimizer and workload.

  Example:
    >>> from logra_jax import configs, parallel
    >>> describe("tiny", 8e5, parallel.MeshConfig(), configs.OptimizerConfig(
    ...     name="adam", target_kl=0.01), None, ", seq 64")
    'tiny (0.00B params), mesh dp=1,fsdp=1,tp=1, adam, KL control (target 0.01), seq 64'
  """
  return (
      f"{name} ({num_params / 1e9:.2f}B params), mesh {mesh}, {opt.name}"
      + (
          f" rank {opt.rank}, {opt.gradient_mode} gradients"
          if opt.name == "logra"
          else f" rank {opt.rank}"
          if opt.name == "lora"
          else ""
      )
      + (", embeddings projected" if opt.project_embeddings else "")
      + (", embeddings frozen" if opt.freeze_embeddings else "")
      + (f", {opt.base_dtype} base" if opt.base_dtype != "float32" else "")
      + (
          f", {opt.coords_dtype} coordinates"
          if opt.coords_dtype != "float32"
          else ""
      )
      + (f", {opt.step_bits}-bit steps" if opt.step_bits else "")
      + (f", {reference_dtype} reference policy" if reference_dtype else "")
      + (
          f", KL control (target {opt.target_kl:g}"
          + (f", kl_subsample {opt.kl_subsample})" if opt.kl_subsample else ")")
          if opt.target_kl
          else ""
      )
      + workload
  )


def workload(
    seq_len: int,
    micro_batch: tuple[int, int],
    remat: str,
    rollout: tuple[int, int, int],
    copy: bool,
) -> str:
  """The workload part of a plan's description (``plan_memory``'s arguments
  of the same names; ``micro_batch``: its micro_batch and micro_batches;
  ``rollout``: its seqs, tokens and turn tokens).

  Example:
    >>> workload(2048, (1, 1), "block", (64, 1024, 0), False)
    ', seq 2048, micro-batch 1/device, remat block, rollout 64x1024 tokens (shared weights)'
  """
  seqs, tokens, turn = rollout
  size, chunks = micro_batch
  text = f", seq {seq_len}, micro-batch {size}/device" + (
      f" x {chunks} micro-batches" if chunks > 1 else ""
  )
  text += f", remat {remat}"
  if seqs:
    text += f", rollout {seqs}x{tokens} tokens" + (
        " (own copy)" if copy else " (shared weights)"
    )
  if seqs and turn:
    text += f", turns of {turn} tokens"
  return text
