"""YAML run configs and overrides: a preset, files and overrides compose in
that order into the same frozen dataclasses a Python user builds, and every
bad key, value or file is refused naming it."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from logra_jax import cli
from logra_jax import configs

SMOKE = configs.get_preset("smoke")

RUN_YAML = """\
task:
  name: chain_sum
  options:
    min_terms: 2
    max_terms: 4
  template: "Q: {prompt} A:"
policy:
  hidden_size: 64
rewards:
  - function: task
  - function: my_rewards.py:brevity
    weight: -0.1
logging:
  trackers: []
steps: 7
"""


def _write(tmp_path, text, name="run.yaml"):
  path = tmp_path / name
  path.write_text(textwrap.dedent(text))
  return path


def test_yaml_with_nested_and_list_values_equals_the_config_built_in_python(
    tmp_path,
):
  path = _write(tmp_path, RUN_YAML)
  loaded = configs.load_config(
      "smoke",
      [path],
      [
          "task.options.max_digits=3",
          "optimizer.rank=8",
          "logging.trackers=[tensorboard]",
      ],
  )
  built = dataclasses.replace(
      SMOKE,
      task=dataclasses.replace(
          SMOKE.task,
          name="chain_sum",
          template="Q: {prompt} A:",
          options={"min_terms": 2, "max_terms": 4, "max_digits": 3},
      ),
      policy=dataclasses.replace(SMOKE.policy, hidden_size=64),
      optimizer=dataclasses.replace(SMOKE.optimizer, rank=8),
      rewards=[
          configs.RewardConfig("task"),
          configs.RewardConfig("my_rewards.py:brevity", -0.1),
      ],
      logging=configs.LoggingConfig(trackers=["tensorboard"]),
      steps=7,
  )
  assert loaded == built
  assert isinstance(loaded.rewards[1], configs.RewardConfig)


def test_preset_then_file_then_overrides(tmp_path):
  path = _write(tmp_path, "steps: 7\nseed: 5\n")
  config = configs.load_config("smoke", [path], ["steps=9"])
  # The override beats the file, the file beats the preset, and the
  # preset's other fields stay.
  assert (config.steps, config.seed, config.rollout.prompts_per_step) == (
      9,
      5,
      SMOKE.rollout.prompts_per_step,
  )
  # Maps merge key by key; lists are replaced.
  second = _write(
      tmp_path,
      "task: {options: {max_terms: 5}}\n" "logging: {trackers: [wandb]}\n",
      "second.yaml",
  )
  config = configs.load_config("smoke", [_write(tmp_path, RUN_YAML), second])
  assert config.task.options == {"min_terms": 2, "max_terms": 5}
  assert config.logging.trackers == ["wandb"]


def test_the_cli_composes_preset_config_files_set_and_positional_overrides(
    tmp_path,
):
  path = _write(tmp_path, "steps: 7\nseed: 5\noptimizer: {rank: 2}\n")
  args = cli.build_parser().parse_args(
      [
          "train",
          "--preset=smoke",
          f"--config={path}",
          "--set=seed=6",
          "optimizer.rank=3",
          "task.options={max_terms: 4}",
      ]
  )
  config = cli._config(args)
  assert (config.steps, config.seed, config.optimizer.rank) == (7, 6, 3)
  assert config.task.options == {"max_terms": 4}


def test_a_saved_config_reads_back_equal():
  config = configs.apply_overrides(
      SMOKE,
      [
          "rewards=[{function: task}, {function: 'a.b:c', weight: 2}]",
          "task.options={max_terms: 4, min_terms: 2}",
          "optimizer.target_kl=0.001",
          "task.system_prompt=null",
      ],
  )
  assert configs.from_dict(configs.to_dict(config)) == config


def test_presets_are_the_package_yaml_files():
  assert configs.preset_names() == ["smoke", "tiny"]
  assert configs.get_preset("tiny") == configs.TrainConfig()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "optimizer.rnk=3",
            "override 'optimizer.rnk=3': unknown config key "
            "optimizer.rnk; valid keys there: ['b1', 'b2', 'base_dtype'",
        ),
        (
            "bogus=1",
            "unknown config key bogus; valid keys there: ['advantage', "
            "'checkpoint'",
        ),
        (
            "rewards=[{function: task, wt: 2}]",
            "unknown config key rewards.wt; "
            "valid keys there: ['batch_timeout_s', 'function', 'weight']",
        ),
        (
            "logging.colour=1",
            "unknown config key logging.colour; valid keys "
            "there: ['realized_kl_every', 'samples_every', "
            "'samples_shown', 'trackers']",
        ),
        (
            "optimizer.rank=abc",
            "optimizer.rank: Value 'abc' of type 'str' could "
            "not be converted to Integer",
        ),
        (
            "steps=[1, 2]",
            "steps: Value '[1, 2]' of type 'ListConfig' could not "
            "be converted to Integer",
        ),
        (
            "optimizer.target_kl=none",
            "optimizer.target_kl: Value 'none' of type "
            "'str' could not be converted to Float (write null to clear",
        ),
        ("task.options=[1]", "override 'task.options=[1]': Cannot merge"),
        ("optimizer=3", "override 'optimizer=3': "),
        (
            "optimizer.rank",
            "override 'optimizer.rank' must look like " "section.field=value",
        ),
        (
            "logging.trackers=[mlflow]",
            "logging.trackers must be one of "
            "('tensorboard', 'wandb'), got 'mlflow'",
        ),
        (
            "logging.trackers=[wandb, wandb]",
            "logging.trackers lists a tracker " "twice",
        ),
        (
            "task.chat_template=jinja",
            "task.chat_template must be one of ('auto', "
            "'none'), got 'jinja'",
        ),
        (
            "rewards=[{function: nocolon}]",
            "rewards.function='nocolon' must be "
            "'task', 'package.module:function' or 'path/to/file.py:function'",
        ),
        (
            "rewards=[{function: task, weight: .nan}]",
            "rewards.weight must be a " "finite number",
        ),
        (
            "loss.aggregation=mean",
            "loss.aggregation must be one of " "('token-mean'",
        ),
    ],
)
def test_bad_keys_and_values_are_refused_naming_them(override, message):
  with pytest.raises(ValueError) as info:
    configs.load_config("smoke", overrides=[override])
  assert message in str(info.value)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps: [7\n", "is not valid YAML: while parsing a flow sequence"),
        (
            "- steps: 7\n",
            "must be a map of config sections and fields, got list",
        ),
        (
            "just a string\n",
            "must be a map of config sections and fields, got " "str",
        ),
        (
            "optimizer:\n  rank: 2\n  rnak: 3\n",
            "unknown config key " "optimizer.rnak",
        ),
        ("optimizer: 3\n", "config file"),
        (
            "optimizer: {rank: 8}\nsteps: 3\noptimizer: {name: adam}\n",
            "key 'optimizer' is given twice",
        ),
    ],
)
def test_bad_config_files_are_refused_naming_the_file(tmp_path, text, message):
  path = _write(tmp_path, text)
  with pytest.raises(ValueError) as info:
    configs.load_config("smoke", [path])
  assert str(info.value).startswith(f"config file {path}")
  assert message in str(info.value)
  assert "\n" not in str(info.value)


def test_seeds_fit_a_prng_key():
  with pytest.raises(
      ValueError, match=r"^seed must be in \[0, 9223372036854775807\]"
  ):
    configs.load_config("smoke", overrides=[f"seed={2**63}"])


def test_a_missing_config_file_or_preset_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.yaml: no such file"):
    configs.load_config("smoke", [tmp_path / "missing.yaml"])
  with pytest.raises(
      ValueError,
      match="unknown preset 'huge'; valid " r"presets: \['smoke', 'tiny'\]",
  ):
    configs.load_config("huge")


def test_an_empty_config_file_changes_nothing(tmp_path):
  assert configs.load_config("smoke", [_write(tmp_path, "")]) == SMOKE


def test_configs_import_nothing_of_the_rl_code():
  code = (
      "import sys, logra_jax.configs; "
      "print(sorted(m for m in sys.modules "
      "if m.startswith(('logra_jax.rl', 'logra_jax.rollout'))))"
  )
  out = subprocess.run(
      [sys.executable, "-c", code], check=True, capture_output=True, text=True
  ).stdout
  assert out.strip() == "[]"


def test_text_fields_take_the_text_as_written(tmp_path):
  config = configs.load_config(
      "smoke",
      overrides=[
          "task.answer_after=#### ",
          "task.system_prompt=Note: be brief, use #tags",
          "task.template=Price ${price} of {prompt}",
          "task.chat_template='none'",
      ],
  )
  assert config.task.answer_after == "#### "
  assert config.task.system_prompt == "Note: be brief, use #tags"
  assert config.task.template == "Price ${price} of {prompt}"
  assert config.task.chat_template == "none"
  # ${...} is text, not an interpolation, in files and after a round trip.
  path = _write(tmp_path, 'task: {template: "Cost ${cost}: {prompt}"}\n')
  assert (
      configs.load_config("smoke", [path]).task.template
      == "Cost ${cost}: {prompt}"
  )
  saved = _write(tmp_path, configs.to_yaml(config), "saved.yaml")
  assert configs.load_config("tiny", [saved]) == config
  assert configs.from_dict(configs.to_dict(config)) == config
  # null still clears an optional text field.
  assert (
      configs.load_config(
          "smoke", overrides=["task.answer_after=#", "task.answer_after=null"]
      ).task.answer_after
      is None
  )


def test_an_override_of_another_field_is_never_an_interpolation():
  # ${steps} would resolve to the preset's steps (3) as an interpolation.
  with pytest.raises(ValueError, match=r"optimizer\.rank.*\$\{steps\}"):
    configs.load_config("smoke", overrides=["optimizer.rank=${steps}"])
  config = configs.load_config(
      "smoke", overrides=["task.options={note: '${steps}'}"]
  )
  assert config.task.options == {"note": "${steps}"}
