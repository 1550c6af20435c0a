"""Run configs: every field is checked when the config is built, naming it
as ``--set`` does, so bad input fails before any file or compile."""

import dataclasses
import re
import typing

import pytest

from logra_jax import configs

SMOKE = configs.get_preset("smoke")


def _numeric_keys(config, prefix=""):
  """``(key, type)`` of every int and float field, as ``--set`` spells the
  key, found by walking the dataclasses (so a new field is covered too)."""
  hints = typing.get_type_hints(type(config))
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      yield from _numeric_keys(value, f"{prefix}{field.name}.")
      continue
    types = [
        t for t in typing.get_args(hints[field.name]) if t is not type(None)
    ] or [hints[field.name]]
    if types[0] in (int, float):
      yield f"{prefix}{field.name}", types[0]


FLOAT_KEYS = [k for k, t in _numeric_keys(SMOKE) if t is float]
INT_KEYS = [k for k, t in _numeric_keys(SMOKE) if t is int]


def _refused(overrides, key):
  """The error of ``overrides``, which must start with ``key``."""
  with pytest.raises(ValueError, match=rf"^{re.escape(key)} must be") as info:
    configs.apply_overrides(SMOKE, overrides)
  assert "\n" not in str(info.value)
  return str(info.value)


def test_every_section_has_float_and_int_fields_to_check():
  # The walk finds the fields of every section, the loss included.
  assert {
      "optimizer.learning_rate",
      "optimizer.b1",
      "rollout.temperature",
      "policy.warm_start_lr",
      "loss.beta",
      "loss.eps_high",
      "checkpoint.every_seconds",
      "optimizer.target_kl",
  } <= set(FLOAT_KEYS)
  assert {
      "seed",
      "task.seed",
      "rollout.top_k",
      "loss.max_len",
      "optimizer.kl_subsample",
  } <= set(INT_KEYS)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_non_finite_floats_are_refused_naming_the_field(key, value):
  message = _refused([f"{key}={value}"], key)
  assert "finite number" in message and message.endswith(f"got {value}")


@pytest.mark.parametrize("key", INT_KEYS)
def test_negative_ints_are_refused_naming_the_field(key):
  # No count, size, seed or index of a run is negative.
  assert _refused([f"{key}=-1"], key).endswith("got -1")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optimizer.b1=5", "optimizer.b1 must be in [0, 1), got 5.0"),
        ("optimizer.b1=1", "optimizer.b1 must be in [0, 1), got 1.0"),
        ("optimizer.b2=1", "optimizer.b2 must be in [0, 1), got 1.0"),
        (
            "optimizer.learning_rate=0",
            "optimizer.learning_rate must be > 0, got 0.0",
        ),
        ("rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0.0"),
        ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1], got 1.5"),
        ("rollout.top_k=-5", "rollout.top_k must be >= 0, got -5"),
        ("loss.eps_low=1", "loss.eps_low must be in [0, 1), got 1.0"),
        ("loss.kl_clamp=0", "loss.kl_clamp must be > 0, got 0.0"),
        ("seed=-1", "seed must be in [0, 9223372036854775807], got -1"),
        (
            "rollout.num_generations=1",
            "rollout.num_generations must be >= 2, " "got 1",
        ),
    ],
)
def test_out_of_range_values_are_refused_with_the_range(override, expected):
  assert _refused([override], override.split("=")[0]) == expected


def test_boundary_values_are_accepted():
  config = configs.apply_overrides(
      SMOKE,
      [
          "optimizer.b1=0",
          "optimizer.b2=0",
          "optimizer.max_grad_norm=0",
          "optimizer.weight_decay=0",
          "rollout.top_p=1",
          "rollout.top_k=0",
          "loss.beta=0",
          "loss.eps_low=0",
          "loss.eps_high=0",
          "seed=0",
          "checkpoint.every_seconds=0",
          "optimizer.target_kl=1e-9",
      ],
  )
  assert config.optimizer.b1 == 0.0 and config.rollout.top_p == 1.0


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "optimizer.kind=bogus",
            "optimizer.kind must be one of ('range', "
            "'random', 'svd'), got 'bogus'",
        ),
        (
            "optimizer.moment_policy=bogus",
            "optimizer.moment_policy must be one "
            "of ('transfer', 'keep', 'reset'), got 'bogus'",
        ),
        (
            "optimizer.coords_dtype=float16",
            "optimizer.coords_dtype must be one of ('float32', 'bfloat16'), "
            "got 'float16'",
        ),
        (
            "optimizer.name=adam optimizer.coords_dtype=bfloat16",
            "optimizer.coords_dtype='bfloat16' needs the factored policy",
        ),
        (
            "policy.num_heads=3",
            "policy.num_heads=3 must divide " "policy.hidden_size=32",
        ),
        (
            "policy.num_kv_heads=3",
            "policy.num_kv_heads=3 must divide " "policy.num_heads=2",
        ),
        (
            "policy.num_heads=32",
            "policy.hidden_size=32 / policy.num_heads=32 = 1 "
            "must be even (the head size, for rotary embeddings)",
        ),
    ],
)
def test_choices_and_head_counts_are_checked_at_once(override, expected):
  with pytest.raises(ValueError) as info:
    configs.apply_overrides(SMOKE, override.split())
  assert str(info.value).startswith(expected)
