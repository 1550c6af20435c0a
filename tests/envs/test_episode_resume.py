"""Resuming a run of multi-turn episodes is bit-exact: 4 steps with
checkpoints every 2 equal 2 steps, then the same run resumed to 4."""

import dataclasses
import textwrap

from logra_jax import configs
from logra_jax.rl import trainer
from run_fixtures import assert_same_state
from run_fixtures import final_state
from run_fixtures import run_metrics
from run_fixtures import run_overrides

SMOKE = configs.get_preset("smoke")
QUIET = lambda s: None  # noqa: E731

# Every turn is answered, so each episode plays all its turns.
AGAIN = """
from logra_jax import envs

class Again:
  def reset(self, example):
    return [{"role": "user", "content": example["prompt"]}]

  def step(self, model_message):
    return envs.StepResult([{"role": "user", "content": "again"}], reward=0.5)

def again():
  return Again()
"""


def test_a_resumed_multi_turn_run_equals_the_uninterrupted_run(
    tmp_path, policy_folder, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "again.py").write_text(textwrap.dedent(AGAIN))
  config = configs.apply_overrides(
      SMOKE,
      [
          *run_overrides(policy_folder, steps=4, every=2),
          "task.environment=again.py:again",
          "rollout.max_turns=2",
          "rollout.prompts_per_step=2",
          "micro_batches=2",
          "task.eval_size=4",
      ],
  )
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  trainer.train(config, straight, progress=False, log=QUIET)
  first = trainer.train(
      dataclasses.replace(config, steps=2), stopped, progress=False, log=QUIET
  )
  second = trainer.train(
      config, stopped, progress=False, log=QUIET, resume=True
  )
  assert first["checkpoint_steps"] == [2]
  assert second["resumed_from_step"] == 2 and second["steps"] == 4
  a, b = final_state(straight, config), final_state(stopped, config)
  assert a.step == b.step == 4
  assert_same_state(a, b)  # bit for bit
  metrics = run_metrics(stopped)
  assert metrics == run_metrics(straight)
  assert all(m["env/turns_per_episode"] == 2.0 for m in metrics)
