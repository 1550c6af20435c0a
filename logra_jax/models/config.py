"""Typed configuration of the decoder (Llama / Qwen2 / Qwen3 families)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import transformers

Family = Literal["llama", "qwen2", "qwen3"]
RematPolicy = Literal["none", "block", "dots_saveable"]

# HF `architectures` entry and `model_type` for each supported family.
HF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# float64 only under jax_enable_x64, for reference computations in tests.
_DTYPES = ("float32", "bfloat16", "float16", "float64")
REMAT = ("none", "block", "dots_saveable")
# DecoderConfig.attention: the setting, or the implementation it names.
ATTENTION = ("auto", "chunked", "xla", "cudnn")
_FUSED_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash kernel takes


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (the HF `rope_parameters` of type linear / llama3).

  Attributes:
    kind: "linear" (divide every frequency by `factor`) or "llama3" (Llama 3.1
      smooth interpolation between low and high frequencies).
    factor: the scaling factor.
    low_freq_factor: llama3 only.
    high_freq_factor: llama3 only.
    original_max_position_embeddings: llama3 only; pretraining context length.
  """

  kind: Literal["linear", "llama3"]
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.kind not in ("linear", "llama3"):
      raise ValueError(
          f"RopeScaling.kind must be 'linear' or 'llama3', got {self.kind!r}."
      )
    if self.factor <= 0:
      raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}.")
    if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          "RopeScaling llama3 needs high_freq_factor > low_freq_factor, got "
          f"{self.high_freq_factor} <= {self.low_freq_factor}."
      )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Configuration of a decoder-only transformer (Llama, Qwen2, Qwen3).

  Attributes:
    vocab_size: V.
    hidden_size: D.
    intermediate_size: F, the SwiGLU width.
    num_layers: L.
    num_heads: H, query heads.
    num_kv_heads: K, key/value heads (grouped-query attention; H % K == 0).
    head_dim: hd; may differ from D // H.
    family: "llama", "qwen2" or "qwen3" (selects the HF export class).
    rope_theta: RoPE base.
    rope_scaling: optional linear / llama3 frequency scaling.
    rms_norm_eps: epsilon of every RMSNorm.
    tie_word_embeddings: if True the LM head is the transposed embedding.
    attention_bias: biases on q/k/v projections.
    attention_out_bias: bias on the output projection (HF Llama/Qwen3 put it
      there whenever `attention_bias` is set; Qwen2 never does).
    qk_norm: per-head RMSNorm of queries and keys (Qwen3).
    max_position_embeddings: context length recorded for export.
    bos_token_id: recorded for export.
    eos_token_ids: stop ids recorded for export and used as sampler default.
    pad_token_id: recorded for export.
    initializer_range: std of the normal init of matrices and embeddings.
    remat: activation checkpointing of each block: "none", "block" (save only
      block inputs) or "dots_saveable" (save the outputs of matmuls without
      batch dimensions, i.e. the weight projections; recompute attention).
    attention_chunk: queries per attention block when more than this many
      tokens are processed at once (training, prefill): the score matrix is
      at most `attention_chunk x S` per (batch, head) and each block is
      recomputed in the backward pass.
    attention: how attention over more than one query is computed:
      "chunked" (einsums over query blocks of `attention_chunk`, the
      portable path and the reference), "xla" or "cudnn"
      (`jax.nn.dot_product_attention` with that implementation; "cudnn" is
      the fused flash kernel, on GPUs with a bfloat16 or float16 compute
      dtype) or "auto" ("cudnn" where it runs, else "chunked"; see
      `attention_implementation`). Decoding one token always uses the
      chunked path's in-place reduction over the cache.
    dtype: compute dtype ("float32" or "bfloat16"; "float16", and "float64"
      under ``jax_enable_x64`` for reference computations); logits are
      always float32 or wider.
    param_dtype: storage dtype of parameters.
    batch_invariant: every sum in an order fixed by one row's shapes
      (:mod:`logra_jax.reduction`): matmuls as pairwise sums of products
      over 256-long slices, RMSNorm and the attention softmax as tree sums,
      attention's value sum over 256-key blocks, and a decoded token's key
      written into the cache before it is attended over with the forward's
      matmuls (the chunked attention path, always). With kernels that are
      row-invariant for such slices (XLA:CPU with
      `logra_jax.reduction.CPU_FLAGS`, the sampler compiled with
      `logra_jax.reduction.CPU_SAMPLER_OPTIONS`) a sampler's log-probs are
      then bitwise a forward pass's, whatever the batch.

  Example:
    >>> cfg = DecoderConfig.tiny(vocab_size=128)
    >>> cfg.num_layers, cfg.hidden_size
    (2, 64)
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  family: Family = "llama"
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  attention_out_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 2048
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  initializer_range: float = 0.02
  remat: RematPolicy = "none"
  attention_chunk: int = 512
  attention: str = "auto"
  dtype: str = "float32"
  param_dtype: str = "float32"
  batch_invariant: bool = False

  def __post_init__(self):
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
      value = getattr(self, name)
      # Sizes reach jitted code as int32 (JAX's default integer).
      if not isinstance(value, int) or not 1 <= value < 2**31:
        raise ValueError(
            f"DecoderConfig.{name} must be a positive int below 2**31, got "
            f"{value!r}."
        )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
          f"({self.num_kv_heads})."
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}.")
    if self.family not in HF_ARCHITECTURES:
      raise ValueError(
          f"family must be one of {sorted(HF_ARCHITECTURES)}, got "
          f"{self.family!r}."
      )
    if self.remat not in REMAT:
      raise ValueError(f"remat must be one of {REMAT}, got {self.remat!r}.")
    if self.attention not in ATTENTION:
      raise ValueError(
          f"attention must be one of {ATTENTION}, got {self.attention!r}."
      )
    if self.batch_invariant and self.attention not in ("auto", "chunked"):
      raise ValueError(
          "batch_invariant computes attention with the chunked einsums; "
          f"attention={self.attention!r} asks for a fused kernel"
      )
    if self.attention_chunk < 1:
      raise ValueError(
          f"attention_chunk must be >= 1, got {self.attention_chunk}."
      )
    for name in ("dtype", "param_dtype"):
      value = jnp.dtype(getattr(self, name)).name
      if value not in _DTYPES:
        raise ValueError(f"{name} must be one of {_DTYPES}, got {value!r}.")
      object.__setattr__(self, name, value)
    object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
    if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
      raise ValueError(
          "rope_theta and rms_norm_eps must be > 0, got "
          f"{self.rope_theta} and {self.rms_norm_eps}."
      )

  def replace(self, **changes: Any) -> DecoderConfig:
    """Returns a copy with `changes` applied (and validated)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def tiny(cls, vocab_size: int = 256, **overrides: Any) -> DecoderConfig:
    """A 2-layer, D=64 preset (4 heads, 2 kv heads, F=128) for tests.

    Args:
      vocab_size: V.
      **overrides: any other field.

    Returns:
      The config.

    Example:
      >>> DecoderConfig.tiny(vocab_size=100).num_kv_heads
      2
    """
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    fields.update(overrides)
    return cls(**fields)

  @classmethod
  def from_hf(cls, hf_config: Any, **overrides: Any) -> DecoderConfig:
    """Builds the config from a `transformers` config (`AutoConfig` output).

    Args:
      hf_config: a `LlamaConfig`, `Qwen2Config` or `Qwen3Config`.
      **overrides: fields not stored by HF (`remat`, `attention_chunk`,
        `attention`, `dtype`, `param_dtype`).

    Returns:
      The config.

    Raises:
      ValueError: unsupported architecture, activation, MLP bias, sliding
        window or RoPE type.

    Example:
      >>> import transformers
      >>> hf = transformers.Qwen3Config(
      ...     vocab_size=64, hidden_size=32, intermediate_size=64,
      ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
      ...     head_dim=24)
      >>> DecoderConfig.from_hf(hf).head_dim
      24
    """
    family = hf_config.model_type
    _check_hf_supported(hf_config)
    rope_theta, scaling = _hf_rope(hf_config)
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    attention_bias = (
        True if family == "qwen2" else bool(hf_config.attention_bias)
    )
    eos = hf_config.eos_token_id
    eos_ids = (
        () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    )
    fields = dict(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=(
            hf_config.num_key_value_heads or hf_config.num_attention_heads
        ),
        head_dim=head_dim,
        family=family,
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        attention_bias=attention_bias,
        attention_out_bias=attention_bias and family != "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=hf_config.max_position_embeddings,
        bos_token_id=hf_config.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=hf_config.pad_token_id,
        initializer_range=float(hf_config.initializer_range),
    )
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> Any:
    """Returns the matching `transformers` config for export.

    Returns:
      A `LlamaConfig`, `Qwen2Config` or `Qwen3Config`.

    Raises:
      ValueError: the flags cannot be expressed by the family's HF class.

    Example:
      >>> type(DecoderConfig.tiny(family="qwen3", qk_norm=True).to_hf()).__name__
      'Qwen3Config'
    """
    expected_norm = self.family == "qwen3"
    if self.qk_norm != expected_norm:
      raise ValueError(
          f"family {self.family!r} requires qk_norm="
          f"{expected_norm}, got {self.qk_norm}."
      )
    if self.family == "qwen2":
      if not self.attention_bias or self.attention_out_bias:
        raise ValueError(
            "family 'qwen2' requires attention_bias=True and "
            "attention_out_bias=False."
        )
    elif self.attention_out_bias != self.attention_bias:
      raise ValueError(
          f"family {self.family!r} requires attention_out_bias == "
          "attention_bias."
      )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": self.rope_theta,
    }
    if self.rope_scaling is not None:
      rope.update(
          rope_type=self.rope_scaling.kind, factor=self.rope_scaling.factor
      )
      if self.rope_scaling.kind == "llama3":
        rope.update(
            low_freq_factor=self.rope_scaling.low_freq_factor,
            high_freq_factor=self.rope_scaling.high_freq_factor,
            original_max_position_embeddings=(
                self.rope_scaling.original_max_position_embeddings
            ),
        )
    eos = list(self.eos_token_ids)
    kwargs: dict[str, Any] = dict(
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads,
        num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim,
        hidden_act="silu",
        max_position_embeddings=self.max_position_embeddings,
        rms_norm_eps=self.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=self.tie_word_embeddings,
        initializer_range=self.initializer_range,
        bos_token_id=self.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=self.pad_token_id,
        architectures=[HF_ARCHITECTURES[self.family]],
        dtype=self.param_dtype,
    )
    if self.family != "qwen2":
      kwargs["attention_bias"] = self.attention_bias
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[self.family]
    return cls(**kwargs)


def attention_implementation(
    attention: str,
    dtype: str,
    platform: str | None = None,
    setting: str = "attention",
) -> tuple[str, str | None]:
  """The attention path that `attention` (`DecoderConfig.attention`)
  selects for compute dtype `dtype` on `platform` (default: JAX's default
  backend), and a one-line notice when "auto" falls back.

  "auto" is "cudnn" on a GPU with a bfloat16 or float16 compute dtype and
  "chunked" elsewhere; on a GPU or TPU that fallback comes with a notice
  saying why (TPU's fused Pallas kernels are not wired in).

  Args:
    attention: "auto", "chunked", "xla" or "cudnn".
    dtype: the compute dtype's name.
    platform: "cpu", "gpu" or "tpu".
    setting: the setting's name in messages (e.g. "policy.attention").

  Returns:
    `(implementation, notice)`: one of "chunked", "xla", "cudnn", and a
    string or None.

  Raises:
    ValueError: an unknown setting, or "cudnn" where it cannot run (not a
      GPU, or a float32 compute dtype), naming the setting and the platform.

  Example:
    >>> attention_implementation("auto", "float32", "cpu")
    ('chunked', None)
    >>> attention_implementation("auto", "bfloat16", "gpu")
    ('cudnn', None)
  """
  if attention not in ATTENTION:
    raise ValueError(
        f"{setting} must be one of {ATTENTION}, got {attention!r}."
    )
  platform = platform or jax.default_backend()
  dtype = jnp.dtype(dtype).name
  fused = platform in ("gpu", "cuda") and dtype in _FUSED_DTYPES
  if attention == "auto":
    if fused:
      return "cudnn", None
    notice = None
    if platform != "cpu":
      notice = f"{setting}=auto: chunked attention on {platform} (" + (
          f"cuDNN's fused kernel needs a bfloat16 or float16 compute dtype, "
          f"not {dtype})"
          if platform in ("gpu", "cuda")
          else "the fused kernels wired in are cuDNN's, for GPUs)"
      )
    return "chunked", notice
  if attention == "cudnn" and not fused:
    raise ValueError(
        f"{setting}='cudnn' runs on GPUs with a bfloat16 or float16 compute "
        f"dtype; here the platform is {platform} and the dtype {dtype} (use "
        f"'auto', 'xla' or 'chunked')"
    )
  return attention, None


def _check_hf_supported(hf_config: Any) -> None:
  """Refuses architectures, activations and options the decoder lacks."""
  family = hf_config.model_type
  architectures = list(
      hf_config.architectures or [HF_ARCHITECTURES.get(family, "")]
  )
  supported = ", ".join(
      f"{a} (model_type {f!r})" for f, a in HF_ARCHITECTURES.items()
  )
  if family not in HF_ARCHITECTURES or any(
      a != HF_ARCHITECTURES[family] for a in architectures
  ):
    raise ValueError(
        f"Unsupported model: architectures={architectures}, "
        f"model_type={family!r}. Supported: {supported}."
    )
  if hf_config.hidden_act != "silu":
    raise ValueError(
        f"Unsupported hidden_act {hf_config.hidden_act!r}; only "
        "'silu' (SwiGLU) is supported."
    )
  if getattr(hf_config, "mlp_bias", False):
    raise ValueError("Unsupported: mlp_bias=True.")
  if getattr(hf_config, "use_sliding_window", False):
    raise ValueError("Unsupported: use_sliding_window=True.")


def _hf_rope(hf_config: Any) -> tuple[float, RopeScaling | None]:
  """The RoPE base and scaling of a `transformers` config."""
  rope = dict(
      getattr(hf_config, "rope_parameters", None)
      or getattr(hf_config, "rope_scaling", None)
      or {}
  )
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 1e4))
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError("Unsupported: partial_rotary_factor != 1.")
  if rope_type == "default":
    scaling = None
  elif rope_type == "linear":
    scaling = RopeScaling("linear", float(rope["factor"]))
  elif rope_type == "llama3":
    scaling = RopeScaling(
        "llama3",
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(
            rope.get(
                "original_max_position_embeddings",
                hf_config.max_position_embeddings,
            )
        ),
    )
  else:
    raise ValueError(
        f"Unsupported rope type {rope_type!r}; supported: "
        "'default', 'linear', 'llama3'."
    )
  return rope_theta, scaling
