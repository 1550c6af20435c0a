"""The optimizer section of a run's config: :class:`OptimizerConfig`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from logra_jax.checks import check_choice, check_fields
from logra_jax.optim.factored import BASE_DTYPES
from logra_jax.optim.factored import COORDS_DTYPES
from logra_jax.optim.kl_control import KL_MODES
from logra_jax.optim.lora import DEFAULT_TARGETS as LORA_TARGETS
from logra_jax.optim.projectors import KINDS
from logra_jax.optim.step_codes import STEP_BITS
from logra_jax.optim.types import MOMENT_POLICIES

OPTIMIZERS = ("logra", "adam", "galore", "lora")
GRADIENT_MODES = ("sketch", "dense")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer of the policy.

  Attributes:
    name: ``"logra"`` (default), ``"adam"`` (dense baseline), ``"galore"``
      (``optax.contrib.galore``) or ``"lora"`` (AdamW on low-rank adapters
      of the frozen policy, :mod:`logra_jax.optim.lora`).
    learning_rate: peak learning rate (constant after warmup).
    warmup_steps: linear warmup.
    rank: projection rank (logra, galore); the adapters' rank (lora).
    kind: projector kind of logra: ``"range"``, ``"random"`` or ``"svd"``.
    refresh_every: steps between projector refreshes (logra, galore).
    moment_policy: logra's moments on refresh.
    weight_decay: decoupled weight decay.
    max_grad_norm: global gradient-norm clip; 0 disables.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    target_kl: predicted-KL target per step (any optimizer); None disables
      KL step control.
    kl_mode: ``"clamp"`` (only shrink steps) or ``"target"``.
    kl_subsample: sequences of the batch the KL is predicted on; None uses
      all.
    gradient_mode: how logra gets its gradient sketches: ``"sketch"``
      (default: differentiated directly in the low-rank coordinates, no full
      gradient is ever held, see :mod:`logra_jax.optim.sketch_grad`) or
      ``"dense"`` (full gradient, then projected). Other optimizers always
      take dense gradients.
    project_embeddings: also project the embedding table and LM head
      (logra, galore), whose dense Adam moments are otherwise the largest
      optimizer state of a large-vocabulary model.
    freeze_embeddings: leave the embedding table and LM head as they are
      (logra, galore, adam): no gradient (``max_grad_norm`` clips the rest's),
      no optimizer moments, and a sync message carries them only when full
      (as LoRA leaves every weight it does not adapt). Under the factored
      policy they are held in ``base_dtype`` where it is narrower than the
      policy's (rounded once, at the start, as the bases are).
    base_dtype: dtype of the base ``B`` of each projected weight, which
      logra with sketch-direct gradients keeps factored, ``W = c B + P A``
      (:mod:`logra_jax.optim.factored`): ``"float32"`` (default) or
      ``"bfloat16"`` (half the bytes; the window is merged into ``B`` with
      stochastic rounding at each refresh, and no float32 copy of the
      weight exists). Dense leaves keep the policy's dtype. Under lora: the
      dtype of the frozen weights the adapters sit on.
    coords_dtype: dtype of the coordinates ``A`` of the factored policy
      (logra with sketch-direct gradients): ``"float32"`` (default) or
      ``"bfloat16"``, every step's new ``A`` stochastically rounded with
      bits that are a pure function of (seed, step, leaf), so that a sync
      message carries the coordinates in half the bytes and the learner
      holds exactly what it sends (:func:`logra_jax.optim.factored.
      apply_updates`).
    step_bits: None (default), 4 or 8: each step's factors ``Delta`` are
      rounded to ``step_bits``-bit codes with a power-of-two scale per row
      and error feedback (:mod:`logra_jax.optim.step_codes`), so that a sync
      message carries them in ``step_bits`` bits per coordinate and the
      learner applies exactly what it sends (logra with sketch-direct
      gradients, float32 coordinates, no weight decay).
    lora_alpha: the adapters' scale numerator, ``s = lora_alpha / rank``
      (lora; a fixed alpha keeps the best learning rate about the same
      across ranks).
    lora_targets: names of the matrices that get adapters (lora); the
      default is every attention and MLP projection.
  """

  name: str = "logra"
  learning_rate: float = 3e-4
  warmup_steps: int = 10
  rank: int = 32
  kind: str = "range"
  refresh_every: int = 50
  moment_policy: str = "transfer"
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.99
  target_kl: Optional[float] = None
  kl_mode: str = "clamp"
  kl_subsample: Optional[int] = None
  gradient_mode: str = "sketch"
  project_embeddings: bool = False
  freeze_embeddings: bool = False
  base_dtype: str = "float32"
  coords_dtype: str = "float32"
  step_bits: Optional[int] = None
  lora_alpha: float = 32.0
  lora_targets: list[str] = dataclasses.field(
      default_factory=lambda: list(LORA_TARGETS)
  )

  def __post_init__(self):
    check_choice("optimizer.name", self.name, OPTIMIZERS)
    check_choice("optimizer.kind", self.kind, KINDS)
    check_choice("optimizer.moment_policy", self.moment_policy, MOMENT_POLICIES)
    check_choice("optimizer.kl_mode", self.kl_mode, KL_MODES)
    check_choice("optimizer.gradient_mode", self.gradient_mode, GRADIENT_MODES)
    check_fields("optimizer", self, "learning_rate target_kl lora_alpha", gt=0)
    if not self.lora_targets or len(set(self.lora_targets)) != len(
        self.lora_targets
    ):
      raise ValueError(
          "optimizer.lora_targets must name at least one matrix, each once; "
          f"got {list(self.lora_targets)}"
      )
    check_fields("optimizer", self, "rank refresh_every kl_subsample", ge=1)
    check_fields(
        "optimizer", self, "warmup_steps weight_decay max_grad_norm", ge=0
    )
    check_fields("optimizer", self, "b1 b2", ge=0, lt=1)
    if self.project_embeddings and self.name in ("adam", "lora"):
      raise ValueError(
          "optimizer.project_embeddings applies to logra and galore; "
          f"{self.name} "
          + (
              "keeps dense moments of every parameter"
              if self.name == "adam"
              else "adapts the matrices of optimizer.lora_targets"
          )
      )
    self._check_freeze_embeddings()
    check_choice("optimizer.base_dtype", self.base_dtype, BASE_DTYPES)
    if self.base_dtype != "float32" and not (
        self.name == "lora"
        or (self.name == "logra" and self.gradient_mode == "sketch")
    ):
      raise ValueError(
          f"optimizer.base_dtype={self.base_dtype!r} needs the frozen base "
          "of optimizer.name='lora' or the factored policy of "
          "optimizer.name='logra' with optimizer.gradient_mode='sketch'; "
          f"got name={self.name!r}, gradient_mode={self.gradient_mode!r}"
      )
    check_choice("optimizer.coords_dtype", self.coords_dtype, COORDS_DTYPES)
    if self.coords_dtype != "float32" and not (
        self.name == "logra" and self.gradient_mode == "sketch"
    ):
      raise ValueError(
          f"optimizer.coords_dtype={self.coords_dtype!r} needs the factored "
          "policy of optimizer.name='logra' with "
          f"optimizer.gradient_mode='sketch'; got name={self.name!r}, "
          f"gradient_mode={self.gradient_mode!r}"
      )
    self._check_step_bits()

  def _check_freeze_embeddings(self):
    if not isinstance(self.freeze_embeddings, bool):
      raise ValueError(
          "optimizer.freeze_embeddings must be true or false, got "
          f"{self.freeze_embeddings!r}"
      )
    if self.freeze_embeddings and self.project_embeddings:
      raise ValueError(
          "optimizer.freeze_embeddings and optimizer.project_embeddings "
          "exclude each other: a frozen embedding is not projected"
      )
    if self.freeze_embeddings and self.name == "lora":
      raise ValueError(
          "optimizer.freeze_embeddings does not apply to lora, which "
          "already leaves every weight but its adapters' (see "
          "optimizer.lora_targets) as it is"
      )

  def _check_step_bits(self):
    if self.step_bits is None:
      return
    if isinstance(self.step_bits, bool) or not isinstance(self.step_bits, int):
      raise ValueError(
          f"optimizer.step_bits must be an int of {STEP_BITS} or None, got "
          f"{self.step_bits!r}"
      )
    check_choice("optimizer.step_bits", self.step_bits, STEP_BITS)
    wrong = [
        f"{name}={value!r}"
        for name, value, wanted in (
            ("name", self.name, "logra"),
            ("gradient_mode", self.gradient_mode, "sketch"),
            ("coords_dtype", self.coords_dtype, "float32"),
            ("weight_decay", self.weight_decay, 0.0),
        )
        if value != wanted
    ]
    if wrong:
      raise ValueError(
          f"optimizer.step_bits={self.step_bits} needs the factored policy "
          "(name='logra', gradient_mode='sketch') with float32 coordinates "
          "and weight_decay=0 (a receiver adds the codes to its "
          f"coordinates); got {', '.join(wrong)}"
      )
