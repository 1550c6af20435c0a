"""The `logra` alias refuses scalar hyperparameters out of range in one
line naming them, as the run config does (NaN passes comparisons, so each
bound is checked for finiteness too); schedules are left to optax."""

import math

import optax
import pytest

import logra_jax


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"learning_rate": math.nan}, "learning_rate must be a finite number"),
        ({"learning_rate": math.inf}, "learning_rate must be a finite number"),
        ({"weight_decay": math.nan}, "weight_decay must be a finite number"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
        ({"eps": -1e-8}, "eps must be a finite number >= 0"),
        ({"b1": 1.5}, r"b1 must be in \[0, 1\), got 1.5"),
        ({"b1": math.nan}, r"b1 must be in \[0, 1\), got nan"),
        ({"b2": 1.0}, r"b2 must be in \[0, 1\), got 1.0"),
    ],
)
def test_out_of_range_hyperparameters_are_refused(kwargs, message):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(ValueError, match=f"^logra: {message}"):
    logra_jax.logra(rank=4, **kwargs)


def test_a_schedule_and_in_range_values_are_accepted():
  schedule = optax.linear_schedule(1e-3, 0.0, 100)
  logra_jax.logra(schedule, rank=4, b1=0.0, b2=0.5, eps=0.0, weight_decay=0.1)
