"""The RL run: policy, data, rollouts, learner steps, evaluation and reports."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import logra_jax as logra
from logra_jax import models
from logra_jax import parallel
from logra_jax.configs.train import TrainConfig, to_dict
from logra_jax.data import tasks as tasks_lib
from logra_jax.data.batching import decode_completions
from logra_jax.rl import algo
from logra_jax.rl import learner as learner_lib
from logra_jax.rl import rewards as rewards_lib
from logra_jax.rl.warm_start import warm_start

Log = Callable[[str], None]


def load_task(config: TrainConfig) -> tasks_lib.Task:
  """The task of a run, from its name and options."""
  task = config.task
  if task.name == "tiny" or task.name == tasks_lib.TINY_TASK:
    return tasks_lib.tiny_arithmetic_task(
        size=task.size, seed=task.seed, min_terms=task.terms,
        max_terms=task.terms, max_digits=task.max_digits)
  if task.name.lower().endswith(tuple(tasks_lib.FILE_BUILDERS)):
    return tasks_lib.file_task(
        task.name, prompt_column=task.prompt_column,
        answer_column=task.answer_column, template=task.template,
        answer_after=task.answer_after)
  return tasks_lib.reasoning_gym_task(task.name, size=task.size,
                                      seed=task.seed)


def task_rewards(task: tasks_lib.Task) -> list[tuple[Callable, float]]:
  """The verifier of a task as weighted reward functions: reasoning-gym's own
  ``score_answer`` when the task has one, else math-verify equivalence."""
  if task.score_answer is not None:
    return [(rewards_lib.reasoning_gym_reward(task.score_answer), 1.0)]
  return [(rewards_lib.math_verify_equivalence, 1.0)]


def _columns(examples: Sequence[dict], repeat: int) -> dict[str, list]:
  keys = [k for k in examples[0] if k != "prompt"]
  return {k: [e[k] for e in examples for _ in range(repeat)] for k in keys}


@dataclasses.dataclass
class Policy:
  """A policy on the host side: weights, tokenizer and a compiled sampler."""

  graphdef: Any
  params: Any
  tokenizer: Any
  sampler: models.Sampler
  folder: pathlib.Path

  @classmethod
  def load(cls, folder: pathlib.Path | str, dtype=jnp.float32,
           mesh: jax.sharding.Mesh | None = None) -> "Policy":
    """Loads an HF folder; under ``mesh``, the weights are placed by the
    partition rules and the sampler is compiled for the mesh."""
    folder = pathlib.Path(folder)
    model = models.load_pretrained(folder, dtype=dtype)
    tokenizer = models.load_tokenizer(folder)
    graphdef, params = models.split_model(model)
    rules = None if mesh is None else parallel.PARTITION_RULES
    if mesh is not None:
      params = jax.device_put(params, parallel.param_shardings(params, mesh))
    return cls(graphdef, params, tokenizer,
               models.Sampler(model, pad_id=tokenizer.pad_token_id or 0,
                              mesh=mesh, rules=rules),
               folder)

  def encode(self, prompts: Sequence[str]) -> list[list[int]]:
    return [self.tokenizer(p)["input_ids"] for p in prompts]

  def decode(self, tokens) -> list[str]:
    return decode_completions(self.tokenizer, np.asarray(tokens),
                              stop_ids=[self.tokenizer.eos_token_id])


def evaluate(policy: Policy, params, examples: Sequence[dict],
             rewards: list[tuple[Callable, float]], max_new_tokens: int,
             batch_size: int = 256) -> dict[str, float]:
  """Greedy held-out accuracy (fraction of completions the verifier scores
  1.0) and mean score."""
  scores = []
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start:start + batch_size])
    prompts = [e["prompt"] for e in chunk]
    out = policy.sampler.sample(params, policy.encode(prompts),
                                jax.random.key(0),
                                max_new_tokens=max_new_tokens, temperature=0.0)
    report = rewards_lib.evaluate_rewards(rewards, prompts,
                                          policy.decode(out.tokens),
                                          _columns(chunk, 1))
    scores.append(report.rewards)
  scores = np.concatenate(scores)
  return {"accuracy": float(np.mean(scores >= 1.0)),
          "score": float(np.mean(scores))}


def rollout(policy: Policy, params, examples: Sequence[dict],
            config: TrainConfig, rewards: list[tuple[Callable, float]],
            key: jax.Array) -> tuple[algo.RolloutBatch, dict[str, float]]:
  """Samples ``num_generations`` completions per prompt, scores them and
  computes group advantages."""
  group = config.rollout.num_generations
  prompts = [e["prompt"] for e in examples for _ in range(group)]
  out = policy.sampler.sample(
      params, policy.encode(prompts), key,
      max_new_tokens=config.rollout.max_new_tokens,
      temperature=config.rollout.temperature, top_p=config.rollout.top_p,
      top_k=config.rollout.top_k)
  report = rewards_lib.evaluate_rewards(rewards, prompts,
                                        policy.decode(out.tokens),
                                        _columns(examples, group))
  rewards_N = jnp.asarray(report.rewards, jnp.float32)
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=out.prompt_ids, prompt_mask_BxP=out.prompt_mask,
      completion_tokens_BxT=out.tokens, completion_mask_BxT=out.mask,
      old_logp_BxT=out.logprobs,
      advantages_B=algo.compute_advantages(rewards_N, group, config.advantage),
      num_generations=group)
  metrics = report.metrics()
  metrics["accuracy/train"] = float(np.mean(report.rewards >= 1.0))
  metrics["completion_length"] = float(np.mean(np.asarray(out.lengths)))
  return batch, metrics


def policy_folder(config: TrainConfig, train_examples: Sequence[dict],
                  log: Log = print) -> pathlib.Path:
  """The HF folder RL starts from: ``policy.path``, or the (cached)
  warm-started policy trained on ``train_examples``' worked answers."""
  if config.policy.path:
    return pathlib.Path(config.policy.path)
  return warm_start(config.policy,
                    train_examples[:config.policy.warm_start_examples],
                    seed=config.task.seed, log=log)


def train(config: TrainConfig, out_dir: str | pathlib.Path,
          progress: bool = True, log: Log = print,
          mesh: parallel.MeshConfig | None = None) -> dict[str, Any]:
  """Runs RL as configured; writes metrics, a plot and ``summary.json``.

  Args:
    config: the run.
    out_dir: output folder (created): ``config.json``, ``metrics.jsonl``,
      ``curves.png``, ``summary.json`` and, when ``tensorboardX`` is
      installed, TensorBoard events under ``tensorboard/``.
    progress: show a progress bar.
    log: where text lines go.
    mesh: optional device mesh (its size must equal the number of devices):
      weights, optimizer state, rollouts and activations are sharded by
      ``parallel.PARTITION_RULES``. The layout does not change the results
      beyond float rounding, so it is not part of ``config``.

  Returns:
    The summary: held-out accuracy before and after, optimizer-state bytes
    of the run's optimizer and of dense Adam, wall time and more.
  """
  start_time = time.perf_counter()
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(to_dict(config), indent=2))
  task = load_task(config)
  train_examples, eval_examples = task.split(config.task.eval_size,
                                             seed=config.task.seed)
  device_mesh = None
  if mesh is not None:
    device_mesh = parallel.make_mesh(mesh)
    rows = config.rollout.prompts_per_step * config.rollout.num_generations
    if rows % (mesh.dp * mesh.fsdp):
      raise ValueError(
          f"the rollout batch of {rows} completions is not divisible by the "
          f"data axes of mesh {mesh} ({mesh.dp * mesh.fsdp})")
  folder = policy_folder(config, train_examples, log)
  policy = Policy.load(folder, dtype=jnp.dtype(config.policy.dtype),
                       mesh=device_mesh)
  rewards = task_rewards(task)
  max_new = config.rollout.max_new_tokens

  params = policy.params
  tx = learner_lib.make_optimizer(config.optimizer, params)
  opt_state = tx.init(params)
  place_batch = lambda batch: batch
  if device_mesh is None:
    train_step = learner_lib.make_train_step(policy.graphdef, tx, config)
  else:
    params_sharding = parallel.param_shardings(params, device_mesh)
    state_sharding = parallel.optimizer_state_shardings(
        tx, params, params_sharding, device_mesh)
    opt_state = jax.device_put(opt_state, state_sharding)
    row = lambda ndim: parallel.batch_sharding(device_mesh, ndim)
    batch_sharding = algo.RolloutBatch(
        prompt_tokens_BxP=row(2), prompt_mask_BxP=row(2),
        completion_tokens_BxT=row(2), completion_mask_BxT=row(2),
        old_logp_BxT=row(2), advantages_B=row(1),
        num_generations=config.rollout.num_generations)
    place_batch = lambda batch: jax.device_put(batch, batch_sharding)
    train_step = learner_lib.make_train_step(
        policy.graphdef, tx, config,
        shardings=(params_sharding, state_sharding, batch_sharding),
        activation_rules=parallel.PARTITION_RULES)
  summary: dict[str, Any] = {
      "optimizer": config.optimizer.name,
      "optimizer_state_bytes": logra.optimizer_state_bytes(opt_state),
      "dense_adam_state_bytes": learner_lib.dense_adam_state_bytes(params),
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
  }
  before = evaluate(policy, params, eval_examples, rewards, max_new)
  summary["eval_accuracy_before"] = before["accuracy"]
  log(f"held-out accuracy before RL: {before['accuracy']:.3f} "
      f"({len(eval_examples)} prompts)")

  batches = tasks_lib.prompt_batches(train_examples,
                                     config.rollout.prompts_per_step,
                                     seed=config.seed)
  key = jax.random.key(config.seed)
  history: list[dict[str, float]] = []
  bar = tqdm.tqdm(range(config.steps), desc="RL", disable=not progress,
                  dynamic_ncols=True)
  interrupted = False
  tensorboard = _tensorboard_writer(out / "tensorboard")
  with open(out / "metrics.jsonl", "w") as metrics_file:
    try:
      for step in bar:
        step_start = time.perf_counter()
        key, rollout_key = jax.random.split(key)
        batch, metrics = rollout(policy, params, next(batches), config,
                                 rewards, rollout_key)
        batch = place_batch(batch)
        rollout_seconds = time.perf_counter() - step_start
        for _ in range(config.num_iterations):
          params, opt_state, step_metrics = train_step(params, opt_state,
                                                       batch)
        metrics.update({k: float(v) for k, v in step_metrics.items()})
        if not math.isfinite(metrics["loss"]):
          raise FloatingPointError(
              f"step {step}: non-finite loss {metrics['loss']}")
        metrics["step"] = step + 1
        metrics["time/rollout_s"] = rollout_seconds
        metrics["time/step_s"] = time.perf_counter() - step_start
        metrics["time/train_s"] = metrics["time/step_s"] - rollout_seconds
        if config.eval_every and (step + 1) % config.eval_every == 0 and (
            step + 1) < config.steps:
          metrics["accuracy/eval"] = evaluate(policy, params, eval_examples,
                                              rewards, max_new)["accuracy"]
        history.append(metrics)
        metrics_file.write(json.dumps(metrics) + "\n")
        metrics_file.flush()
        if tensorboard is not None:
          for name, value in metrics.items():
            tensorboard.add_scalar(name, value, step + 1)
        postfix = {"reward": f"{metrics['reward/total']:.3f}",
                   "acc": f"{metrics['accuracy/train']:.2f}",
                   "kl": f"{metrics['kl/realized']:.1e}"}
        if "kl/predicted" in metrics:
          postfix["kl_pred"] = f"{metrics['kl/predicted']:.1e}"
        bar.set_postfix(postfix)
    except KeyboardInterrupt:
      interrupted = True
      log(f"interrupted after {len(history)} steps; writing results so far")
    finally:
      if tensorboard is not None:
        tensorboard.close()
  after = evaluate(policy, params, eval_examples, rewards, max_new)
  summary.update({
      "eval_accuracy_after": after["accuracy"],
      "eval_score_before": before["score"],
      "eval_score_after": after["score"],
      "steps": len(history),
      "interrupted": interrupted,
      "wall_seconds": time.perf_counter() - start_time,
      "policy_folder": str(folder),
  })
  if history:
    history[-1]["accuracy/eval"] = after["accuracy"]
    plot_curves(history, out / "curves.png", before["accuracy"])
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  log(f"held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
      f"in {len(history)} steps, {summary['wall_seconds']:.0f}s; optimizer "
      f"state {summary['optimizer_state_bytes'] / 2**20:.2f} MiB "
      f"({config.optimizer.name}) vs dense Adam "
      f"{summary['dense_adam_state_bytes'] / 2**20:.2f} MiB")
  return summary


def train_or_reuse(config: TrainConfig, out_dir: str | pathlib.Path,
                   rerun: bool = False) -> dict[str, Any]:
  """:func:`train` quietly, unless ``out_dir`` already holds a finished run
  of the same config; returns its summary. For studies that resume."""
  out = pathlib.Path(out_dir)
  done = (out / "summary.json").exists() and json.loads(
      (out / "config.json").read_text()) == to_dict(config)
  if rerun or not done:
    return train(config, out, progress=False, log=lambda s: None)
  return json.loads((out / "summary.json").read_text())


def _tensorboard_writer(folder: pathlib.Path):
  """A TensorBoard event writer if ``tensorboardX`` is installed, else None."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    return None
  return SummaryWriter(str(folder))


def plot_curves(history: list[dict[str, float]], path: pathlib.Path,
                accuracy_before: float) -> None:
  """Reward/accuracy, realized KL and step time against the step."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [h["step"] for h in history]
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  axes[0].plot(steps, [h["reward/total"] for h in history], label="reward")
  axes[0].plot(steps, [h["accuracy/train"] for h in history],
               label="train accuracy", alpha=0.7)
  evals = [(0, accuracy_before)] + [(h["step"], h["accuracy/eval"])
                                    for h in history if "accuracy/eval" in h]
  axes[0].plot(*zip(*evals), "o-", label="held-out accuracy")
  axes[0].set_title("reward and accuracy")
  axes[0].legend()
  axes[1].plot(steps, [h["kl/realized_k3"] for h in history],
               label="realized (k3)")
  if "kl/predicted" in history[0]:
    axes[1].plot(steps, [h["kl/predicted"] for h in history],
                 label="predicted", alpha=0.7)
    axes[1].legend()
  axes[1].set_yscale("log")
  axes[1].set_title("KL per step")
  axes[2].plot(steps, [h["time/step_s"] for h in history])
  axes[2].set_title("step time (s)")
  for ax in axes:
    ax.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
