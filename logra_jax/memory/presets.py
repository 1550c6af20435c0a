"""Published model configs to plan for, and reading a ``config.json``."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import transformers

from logra_jax import models

# Published configs (config.json fields that set the parameter shapes).
_QWEN = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=32768,
)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "qwen2.5-14b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        _QWEN,
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "qwen3-32b": dict(
        _QWEN,
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    # A 27B-parameter model of the Qwen3 architecture (GQA, q/k RMSNorm,
    # SwiGLU, untied head) at the width and depth of Gemma-3-27B: hidden 5376,
    # MLP 21504, 62 layers, 32 query / 16 kv heads of 128: 27.2B parameters.
    "qwen3-style-27b": dict(
        _QWEN,
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
}


def _config_fields(model: str) -> dict[str, Any]:
  """The ``config.json`` fields of a preset name or a local path."""
  if model in MODEL_PRESETS:
    return dict(MODEL_PRESETS[model])
  path = pathlib.Path(model)
  if path.is_dir():
    path = path / "config.json"
  if not path.suffix == ".json":
    raise ValueError(
        f"unknown model {model!r}: not one of "
        f"{sorted(MODEL_PRESETS)} nor a config.json path"
    )
  if not path.is_file():
    raise ValueError(f"model config file {str(path)!r} does not exist")
  try:
    fields = json.loads(path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ValueError(f"model config file {str(path)!r}: {error}") from None
  if not isinstance(fields, dict):
    raise ValueError(
        f"model config file {str(path)!r} holds a JSON "
        f"{type(fields).__name__}, not an object of config fields"
    )
  return fields


def load_model_config(model: str) -> models.DecoderConfig:
  """A decoder config from a preset name or a local HF ``config.json``.

  Raises:
    ValueError: unknown preset (listing the valid ones), a missing file, or
      an unsupported architecture.

  Example:
    >>> config = load_model_config("qwen2.5-7b")
    >>> config.num_layers, config.num_kv_heads
    (28, 4)
  """
  fields = _config_fields(model)
  model_type = fields.pop("model_type", None)
  if model_type not in models.config.HF_ARCHITECTURES:
    raise ValueError(
        f"unsupported model_type {model_type!r} in {model!r}; supported: "
        f"{sorted(models.config.HF_ARCHITECTURES)}"
    )
  try:
    hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    return models.DecoderConfig.from_hf(hf_config)
  # transformers' checks raise errors of many kinds (huggingface_hub's
  # strict dataclass errors derive from Exception alone).
  except Exception as error:  # noqa: BLE001 -- config construction only.
    raise ValueError(
        f"model config {model!r} is not a valid {model_type} config: "
        + " ".join(str(error).split())
    ) from None
