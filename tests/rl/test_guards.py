"""What guards a run: non-finite steps are skipped (and too many in a row
stop the run), and running out of memory points to `logra memory`."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax import configs
from logra_jax.cli import build_parser
from logra_jax import policy_state
from logra_jax.optim import non_finite
from logra_jax.rl import algo, guards, learner, trainer
from run_fixtures import run_metrics

SMOKE = configs.get_preset("smoke")
QUIET = lambda s: None


def test_nan_gradients_are_skipped_and_the_weights_unchanged(spread_batch):
  policy, batch = spread_batch
  tx = policy_state.make_optimizer(SMOKE.optimizer, policy.params)
  step = learner.make_train_step(policy.graphdef, tx, SMOKE)
  device = jax.devices()[0]  # all committed, as in the trainer
  params, state = jax.device_put(
      policy_state.init_train_state(
          SMOKE.optimizer, tx, jax.tree.map(jnp.copy, policy.params)
      ),
      device,
  )
  batch = jax.device_put(batch, device)
  before = jax.tree.map(np.asarray, (params, state))
  nan_batch = batch.replace(advantages_B=batch.advantages_B.at[0].set(jnp.nan))
  params, state, metrics = step(params, state, nan_batch)
  assert not np.isfinite(float(metrics["loss"]))
  guard = non_finite.non_finite_state(state)
  assert int(guard.skipped_steps) == int(guard.consecutive_skips) == 1
  assert "gradients" in non_finite.non_finite_reasons(guard.reason)
  old_params, old_state = before
  for x, y in zip(
      jax.tree.leaves(old_params), jax.tree.leaves(params), strict=True
  ):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(
      jax.tree.leaves(old_state.inner_state),
      jax.tree.leaves(state.inner_state),
      strict=True,
  ):
    np.testing.assert_array_equal(x, y)
  # A finite batch afterwards is applied and ends the run of skips.
  params, state, metrics = step(params, state, batch)
  guard = non_finite.non_finite_state(state)
  assert int(guard.consecutive_skips) == 0 and int(guard.reason) == 0
  assert int(guard.skipped_steps) == 1 and float(metrics["update_norm"]) > 0
  assert not all(
      np.array_equal(x, y)
      for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(old_params))
  )


def test_guard_names_each_non_finite_quantity():
  import logra_jax as logra

  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.ones(2)}
  tx = non_finite.skip_non_finite(optax.sgd(1.0))
  _, state = tx.update(grads, tx.init(params), params, loss=jnp.inf)
  assert non_finite.non_finite_reasons(state.reason) == ["loss"]
  tx = non_finite.skip_non_finite(optax.sgd(1.0))
  _, state = tx.update(
      {"w": jnp.array([1.0, -jnp.inf])}, tx.init(params), params
  )
  assert non_finite.non_finite_reasons(state.reason) == ["gradients"]
  # With apply_fn, the update is applied inside the guard (zeros if skipped).
  apply = lambda u: optax.apply_updates(params, u)
  new_params, _ = tx.update(grads, tx.init(params), params, apply_fn=apply)
  assert new_params["w"].tolist() == [0.0, 0.0]
  new_params, state = tx.update(
      grads, tx.init(params), params, loss=jnp.nan, apply_fn=apply
  )
  assert new_params["w"].tolist() == [1.0, 1.0] and int(state.reason) == 1
  # A NaN predicted KL: the KL stage already zeroes the step (and counts
  # it); the guard says why.
  tx = non_finite.skip_non_finite(logra.scale_by_predicted_kl(1e-3))
  state = tx.init(params)
  updates, new = tx.update(grads, state, params, kl_predictor=lambda u: jnp.nan)
  assert non_finite.non_finite_reasons(new.reason) == ["predicted KL"]
  assert updates["w"].tolist() == [0.0, 0.0]
  assert int(logra.predicted_kl_state(new).skipped_steps) == 1
  _, new = tx.update(grads, state, params, kl_predictor=lambda u: 0.5)
  assert int(new.reason) == 0 and int(new.consecutive_skips) == 0


def test_consecutive_skips_stop_the_run_naming_step_and_quantity(
    config, tmp_path, monkeypatch
):
  def nan_advantages(rewards_N, *args, **kwargs):
    return jnp.full(rewards_N.shape, jnp.nan, jnp.float32)

  monkeypatch.setattr(algo, "compute_advantages", nan_advantages)
  config = dataclasses.replace(config, max_consecutive_skips=2)
  lines = []
  with pytest.raises(
      FloatingPointError,
      match=r"step 2: 2 consecutive steps skipped for "
      r"non-finite .*gradients",
  ):
    trainer.train(config, tmp_path, progress=False, log=lines.append)
  assert any("step 1: skipped, non-finite" in line for line in lines)
  assert [m["skipped"] for m in run_metrics(tmp_path)] == [1.0, 1.0]


def test_out_of_memory_points_to_logra_memory(config, tmp_path, monkeypatch):
  def out_of_memory(*args, **kwargs):
    def step(*args):
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.0GiB"
      )

    return step

  monkeypatch.setattr(learner, "make_train_step", out_of_memory)
  with pytest.raises(guards.OutOfMemoryError) as error:
    trainer.train(config, tmp_path, progress=False, log=QUIET)
  message = str(error.value)
  assert "step 1: out of memory" in message and "9.0GiB" in message
  command = message.split("with: ")[1].split(" ;")[0]
  assert command.startswith(
      f"logra memory --model " f"{config.policy.path}/config.json"
  )
  # The suggested command is one `logra memory` accepts.
  args = build_parser().parse_args(command.split()[1:])
  assert (args.optimizer, args.rank, args.micro_batch) == ("logra", 4, 16)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [
                "optimizer.name=lora",
                "micro_batches=2",
                "optimizer.target_kl=0.01",
                "optimizer.kl_subsample=4",
                "optimizer.base_dtype=bfloat16",
            ],
            dict(
                optimizer="lora",
                micro_batch=8,
                micro_batches=2,
                target_kl=0.01,
                kl_subsample=4,
                base_dtype="bfloat16",
            ),
        ),
        (
            ["optimizer.name=galore", "optimizer.project_embeddings=true"],
            dict(
                optimizer="logra",
                gradient_mode="dense",
                project_embeddings=True,
                micro_batches=1,
                target_kl=None,
            ),
        ),
        (
            ["optimizer.coords_dtype=bfloat16", "optimizer.kl_subsample=4"],
            dict(coords_dtype="bfloat16", kl_subsample=None, target_kl=None),
        ),
    ],
)
def test_the_suggested_plan_is_the_runs_own(overrides, expected):
  """The out-of-memory error's `logra memory` command plans the run's own
  optimizer (GaLore as LoGRA with dense gradients), micro-batches, KL
  control and dtypes (a subsample without a target plans no predictor)."""
  config = configs.apply_overrides(SMOKE, overrides)
  command = guards.memory_command(config, None, pathlib.Path("p"), 20)
  args = build_parser().parse_args(command.split()[1:])
  assert {k: getattr(args, k) for k in expected} == expected, command


def test_refused_projectors_are_logged_as_they_are_counted():
  lines = []
  watch = guards.NonFiniteProjectors(lines.append)
  for step, count in enumerate([0.0, 0.0, 1.0, 1.0, 3.0], start=1):
    watch.check(step, {"projector/non_finite": count})
  watch.check(6, {})  # a dense optimizer counts none
  assert [line.split(":")[0] for line in lines] == ["step 3", "step 5"]
  assert "2 refreshed projector(s)" in lines[1] and "3 in all" in lines[1]
