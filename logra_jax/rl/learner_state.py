"""The learner of a run: its weights, optimizer state and frozen reference,
where they live on the devices, and the jitted step that updates them."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from logra_jax import optim
from logra_jax import checkpoint
from logra_jax import parallel
from logra_jax import policy_state
from logra_jax.configs import TrainConfig
from logra_jax.optim import non_finite
from logra_jax.optim import sketch_grad
from logra_jax.rl import algo
from logra_jax.rl import learner as learner_lib
from logra_jax.rl import reference as reference_lib
from logra_jax.rollout import engine as engine_lib

Log = Callable[[str], None]


class _Placement(NamedTuple):
  """Where a learner's arrays live, and its step and reference function."""

  params: Any  # the policy's params, placed for the train step
  tx: Any  # the optimizer
  state_sharding: Any  # of the optimizer state
  weights_sharding: Any  # of the weights (policy_state.init_train_state)
  place_batch: Callable  # places a rollout batch
  train_step: Callable
  fill_reference: Optional[Callable]  # reference log-probs (loss.beta > 0)
  fill_proximal: Optional[Callable]  # learner_lib.make_proximal_logprobs
  params_sharding: Any  # of the dense params
  merge_ahead: Optional[Callable]  # learner_lib.make_merge_ahead


class Update(NamedTuple):
  """What the learner's updates on one rollout batch report: the last
  update's metrics, the non-finite guard's state and the quantities an
  update was skipped for."""

  metrics: dict[str, Any]
  guard: non_finite.SkipNonFiniteState
  skipped: set[str]


def _single_device_placement(
    config: TrainConfig, policy: engine_lib.Policy
) -> _Placement:
  """Every input committed to the one device, like restored state and the
  step's outputs: the first step compiles the program all others run."""
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  sharding = jax.sharding.SingleDeviceSharding(
      jax.tree.leaves(policy.params)[0].sharding.device_set.pop()
  )
  fill_reference = (
      reference_lib.make_reference_logprobs(
          policy.graphdef, config.rollout.temperature
      )
      if config.loss.beta > 0
      else None
  )
  return _Placement(
      params=jax.device_put(policy.params, sharding),
      tx=tx,
      state_sharding=sharding,
      weights_sharding=sharding,
      place_batch=lambda batch: jax.device_put(batch, sharding),
      train_step=learner_lib.make_train_step(policy.graphdef, tx, config),
      fill_reference=fill_reference,
      fill_proximal=learner_lib.make_proximal_logprobs(policy.graphdef, config),
      params_sharding=sharding,
      merge_ahead=learner_lib.make_merge_ahead(config),
  )


def _mesh_placement(
    config: TrainConfig, policy: engine_lib.Policy, mesh: jax.sharding.Mesh
) -> _Placement:
  """Weights, optimizer state and batches laid out on ``mesh`` by
  ``parallel.PARTITION_RULES``."""
  params = policy.params
  tx = policy_state.make_optimizer(config.optimizer, params)
  params_sharding = parallel.param_shardings(params, mesh)
  weights = policy_state.abstract_weights(config.optimizer, tx, params)
  weights_sharding = parallel.weight_shardings(weights, params_sharding, mesh)
  # The state follows what the optimizer moves: the params or the adapters.
  state_sharding = parallel.optimizer_state_shardings(
      tx,
      policy_state.optimized(config.optimizer, weights, params),
      policy_state.optimized(
          config.optimizer, weights_sharding, params_sharding
      ),
      mesh,
  )
  row = lambda ndim: parallel.batch_sharding(mesh, ndim)
  rollout_sharding = algo.RolloutBatch(
      prompt_tokens_BxP=row(2),
      prompt_mask_BxP=row(2),
      completion_tokens_BxT=row(2),
      completion_mask_BxT=row(2),
      old_logp_BxT=row(2),
      advantages_B=row(1),
      num_generations=config.rollout.num_generations,
      # An episode's row attends to its environment's tokens too.
      context_mask_BxT=row(2) if config.task.environment else None,
  )
  with_reference = config.loss.beta > 0
  batch_sharding = (
      rollout_sharding.replace(ref_logp_BxT=row(2))
      if with_reference
      else rollout_sharding
  )
  fill_proximal = learner_lib.make_proximal_logprobs(
      policy.graphdef,
      config,
      shardings=(weights_sharding, state_sharding, batch_sharding),
      activation_rules=parallel.PARTITION_RULES,
  )
  if fill_proximal is not None:
    batch_sharding = batch_sharding.replace(proximal_logp_BxT=row(2))
  train_step = learner_lib.make_train_step(
      policy.graphdef,
      tx,
      config,
      shardings=(weights_sharding, state_sharding, batch_sharding),
      activation_rules=parallel.PARTITION_RULES,
  )
  fill_reference = (
      reference_lib.make_reference_logprobs(
          policy.graphdef,
          config.rollout.temperature,
          shardings=(params_sharding, rollout_sharding),
          activation_rules=parallel.PARTITION_RULES,
      )
      if with_reference
      else None
  )
  return _Placement(
      params=params,
      tx=tx,
      state_sharding=state_sharding,
      weights_sharding=weights_sharding,
      place_batch=lambda batch: jax.device_put(batch, rollout_sharding),
      train_step=train_step,
      fill_reference=fill_reference,
      fill_proximal=fill_proximal,
      params_sharding=params_sharding,
      merge_ahead=learner_lib.make_merge_ahead(
          config, (weights_sharding, state_sharding)
      ),
  )


class Learner:
  """The learner of a run: the optimizer, the jitted train step and the
  state they update, laid out on the devices.

  Built by :func:`build_learner`; its state is set by :meth:`init` or
  :meth:`restore`, then changed only by :meth:`update`.

  Attributes:
    params: the policy's dense params, placed for the train step (what the
      learner's weights and the reference are made from).
    tx: the optimizer (``policy_state.make_optimizer``).
    params_sharding: the shardings of the dense params.
    weights: the learner's weights (dense, factored ``(B, A, c)`` or frozen
      with adapters: ``policy_state.init_train_state``).
    opt_state: the optimizer state.
    ref_params: the frozen reference policy (``loss.beta > 0``, else None):
      the initial weights in ``policy.reference_dtype``, laid out like the
      params.
  """

  def __init__(self, config: TrainConfig, placement: _Placement):
    self._config = config
    self._placement = placement
    self.params = placement.params
    self.tx = placement.tx
    self.params_sharding = placement.params_sharding
    self.weights: Any = None
    self.opt_state: Any = None
    self.ref_params = (
        None
        if placement.fill_reference is None
        else reference_lib.reference_params(
            self.params, jnp.dtype(config.policy.reference_dtype)
        )
    )

  def init(self) -> checkpoint.LoopState:
    """Sets the initial weights and optimizer state; the loop state of a
    run at its start."""
    config, placement = self._config, self._placement
    weights, opt_state = policy_state.init_train_state(
        config.optimizer, self.tx, self.params, seed=config.seed
    )
    self.opt_state = jax.device_put(opt_state, placement.state_sharding)
    self.weights = jax.device_put(weights, placement.weights_sharding)
    return checkpoint.LoopState(
        step=0, key=jax.random.key(config.seed), data_position=0
    )

  def restore(
      self,
      checkpointer: checkpoint.Checkpointer,
      meta: dict[str, Any],
      allow_reshard: bool,
      log: Log,
  ) -> checkpoint.LoopState:
    """Sets the state of the newest readable checkpoint (laid out for this
    run); its loop state."""
    config, placement = self._config, self._placement
    restored = checkpointer.restore_latest(
        params=checkpoint.abstract_state(
            policy_state.abstract_weights(
                config.optimizer, self.tx, self.params
            ),
            placement.weights_sharding,
        ),
        opt_state=checkpoint.abstract_state(
            policy_state.abstract_opt_state(
                config.optimizer, self.tx, self.params
            ),
            placement.state_sharding,
        ),
        ref_params=(
            None
            if self.ref_params is None
            else checkpoint.abstract_state(self.ref_params)
        ),
        expected_meta=meta,
        allow_reshard=allow_reshard,
        log=log,
    )
    if restored.step > config.steps:
      raise checkpoint.CheckpointError(
          f"cannot resume: the latest checkpoint in {checkpointer.directory} "
          f"is at step {restored.step}, beyond steps={config.steps}"
      )
    self.weights, self.opt_state = restored.params, restored.opt_state
    self.ref_params = restored.ref_params
    log(
        f"resuming from step {restored.step} "
        f"({checkpointer.directory / str(restored.step)})"
    )
    return restored.loop

  @property
  def state(self) -> tuple[Any, Any]:
    """The learner's weights and optimizer state."""
    return self.weights, self.opt_state

  def prepare(self, batch: algo.RolloutBatch) -> algo.RolloutBatch:
    """A rollout batch placed for the train step, with its reference
    log-probabilities when the loss has a KL term, and its proximal ones
    when its updates share them."""
    batch = self._placement.place_batch(batch)
    if self._placement.fill_reference is not None:
      batch = self._placement.fill_reference(self.ref_params, batch)
    if self._placement.fill_proximal is not None:
      batch = self._placement.fill_proximal(self.weights, self.opt_state, batch)
    return batch

  def update(self, batch: algo.RolloutBatch) -> Update:
    """``config.num_iterations`` updates on one prepared batch."""
    skipped = set()
    for _ in range(self._config.num_iterations):
      self.weights, self.opt_state, metrics = self._placement.train_step(
          self.weights, self.opt_state, batch
      )
      guard = non_finite.non_finite_state(self.opt_state)
      skipped.update(non_finite.non_finite_reasons(guard.reason))
    return Update(metrics, guard, skipped)

  def merge_ahead(self) -> bool:
    """Merges a factored policy's window now when the next update will
    refresh its projectors (:func:`learner_lib.make_merge_ahead`: the merge
    that update begins with, the same values), so that the next rollout is
    sampled from the weights that update differentiates; whether it merged
    (the weights are then new arrays). Engines' copies do the same
    (``merge_ahead_every``)."""
    if self._placement.merge_ahead is None:
      return False
    project = sketch_grad.project_state(self.opt_state)
    if int(project.count) % project.spec.config.refresh_every:
      return False  # no refresh next: no program, no donated arrays
    self.weights = self._placement.merge_ahead(self.weights, self.opt_state)
    return True

  def save(
      self,
      checkpointer: checkpoint.Checkpointer,
      loop: checkpoint.LoopState,
      meta: dict[str, Any],
      eval_accuracy: Optional[float] = None,
      wait: bool = False,
  ) -> None:
    """Saves the learner's state with ``loop`` as checkpoint ``loop.step``."""
    checkpointer.save(
        loop.step,
        params=self.weights,
        opt_state=self.opt_state,
        loop=loop,
        meta=meta,
        ref_params=self.ref_params,
        eval_accuracy=eval_accuracy,
        wait=wait,
    )

  def sizes(self) -> dict[str, Any]:
    """Bytes of the optimizer state (the run's and dense Adam's), of the
    weights as held and of the reference; the number of parameters."""
    return {
        "optimizer": self._config.optimizer.name,
        "optimizer_state_bytes": optim.optimizer_state_bytes(self.opt_state),
        # The learner's weights as held: dense, factored (B, A, c) or
        # frozen with adapters.
        "weights_bytes": sum(x.nbytes for x in jax.tree.leaves(self.weights)),
        "dense_adam_state_bytes": policy_state.dense_adam_state_bytes(
            self.params
        ),
        "num_params": int(sum(x.size for x in jax.tree.leaves(self.params))),
        "reference_bytes": sum(
            x.nbytes for x in jax.tree.leaves(self.ref_params)
        ),
    }


def build_learner(
    config: TrainConfig,
    policy: engine_lib.Policy,
    mesh: jax.sharding.Mesh | None,
) -> Learner:
  """The learner of a run: the optimizer and the jitted train step, with
  the policy's params placed for it (on ``mesh``, or committed to the one
  device), the shardings of the optimizer state and of the learner's
  weights (:func:`policy_state.init_train_state`), and, when
  ``config.loss.beta > 0``, the function that fills in a batch's reference
  log-probabilities. Its state is set by :meth:`Learner.init` or
  :meth:`Learner.restore`."""
  if mesh is None:
    return Learner(config, _single_device_placement(config, policy))
  return Learner(config, _mesh_placement(config, policy, mesh))
