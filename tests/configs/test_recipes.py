"""The shipped recipes and the loss section's bad input: each recipe is a
package YAML file that `--config <name>` reads and that trains the smoke run;
a bad loss field is one line naming it, exit 2, before anything is written."""

import json
import math
import pathlib
import tomllib

import pytest

from logra_jax import configs
from logra_jax.cli import main as cli_main
from run_fixtures import policy_folder  # noqa: F401

RECIPES = ["cispo", "dapo", "dr_grpo", "grpo", "gspo", "rloo"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_recipes_are_package_data_naming_their_source(capsys):
  assert configs.recipe_names() == RECIPES
  assert cli_main(["train", "--list-recipes"]) == 0
  assert capsys.readouterr().out.split() == RECIPES
  data = tomllib.loads((ROOT / "pyproject.toml").read_text())
  patterns = data["tool"]["setuptools"]["package-data"]["logra_jax.configs"]
  package = ROOT / "logra_jax" / "configs"
  shipped = {p for pattern in patterns for p in package.glob(pattern)}
  for name in RECIPES:
    path = configs.RECIPE_DIR / f"{name}.yaml"
    assert path in shipped
    comments = [
        line for line in path.read_text().splitlines() if line[:1] == "#"
    ]
    assert any("arXiv" in line for line in comments), name


def test_a_recipe_name_is_its_file_and_a_file_of_that_name_wins(
    tmp_path, monkeypatch
):
  by_name = configs.load_config("smoke", ["dapo"])
  by_path = configs.load_config("smoke", [configs.RECIPE_DIR / "dapo.yaml"])
  assert by_name == by_path
  assert (by_name.loss.eps_low, by_name.loss.eps_high) == (0.2, 0.28)
  assert by_name.rollout.dynamic_sampling
  monkeypatch.chdir(tmp_path)
  (tmp_path / "dapo").write_text("steps: 9\n")
  assert configs.load_config("smoke", ["dapo"]).loss.eps_high == 0.2
  with pytest.raises(FileNotFoundError, match="nor a recipe name \\(cispo"):
    configs.load_config("smoke", ["dapo2"])


@pytest.mark.parametrize(
    "name, loss",
    [
        ("gspo", dict(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4)),
        ("cispo", dict(policy_loss="cispo", importance_level="token")),
        ("dapo", dict(eps_high=0.28, overlong_buffer=1, overlong_penalty=1.0)),
        ("grpo", dict(beta=0.04, aggregation="seq-mean-token-mean")),
        ("dr_grpo", dict(aggregation="seq-mean-token-sum-norm", beta=0.0)),
    ],
)
def test_recipes_hold_the_papers_hyperparameters(name, loss):
  config = configs.load_config("smoke", [name]).loss
  for field, value in loss.items():
    assert getattr(config, field) == value, field


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_the_smoke_run(
    name, policy_folder, tmp_path  # noqa: F811
):
  out = tmp_path / "run"
  status = cli_main(
      [
          "train",
          "--preset=smoke",
          f"--config={name}",
          "--no-progress",
          f"--out={out}",
          f"policy.path={policy_folder}",
          "steps=2",
          "checkpoint.every_steps=0",
      ]
  )
  assert status == 0
  rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert len(rows) == 2
  for row in rows:
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
  config = configs.load_config("smoke", [name])
  if config.loss.policy_loss != "clip":
    assert {"seq_ratio_mean", "ratio_min", "ratio_max"} <= set(rows[0])
  if config.loss.overlong_buffer:
    assert 0 <= rows[0]["rollout/truncated_fraction"] <= 1
    assert -1 <= rows[0]["reward/overlong_penalty"] <= 0
  if config.rollout.dynamic_sampling:
    assert rows[0]["rollout/resample_rounds"] <= 3


def test_truncated_completions_can_be_masked_from_the_loss(
    policy_folder, tmp_path  # noqa: F811
):
  # The smoke run's 4-token budget cuts every completion of the random
  # policy (it samples its stop token rarely); masked, they move nothing.
  out = tmp_path / "run"
  args = ["train", "--preset=smoke", "--no-progress", f"--out={out}"]
  args += [
      f"policy.path={policy_folder}",
      "steps=1",
      "loss.mask_truncated=true",
  ]
  assert cli_main(args) == 0
  row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
  assert row["rollout/truncated_fraction"] == 1
  assert row["grad_norm"] == 0 and row["loss"] == 0 and row["entropy"] == 0


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "loss.policy_loss=ppo",
            "loss.policy_loss must be one of ('clip', 'gspo', 'gspo_token', "
            "'cispo'), got 'ppo'",
        ),
        (
            "loss.overlong_buffer=4",
            "loss.overlong_buffer=4 must be smaller than "
            "rollout.max_new_tokens=4",
        ),
        ("loss.eps_high=-0.1", "loss.eps_high must be >= 0, got -0.1"),
        ("loss.eps_low=1.5", "loss.eps_low must be in [0, 1), got 1.5"),
        ("loss.eps_low=-0.1", "loss.eps_low must be in [0, 1), got -0.1"),
        (
            "loss.importance_level=sequence",
            "loss.importance_level='sequence' does not apply to "
            "loss.policy_loss='clip'",
        ),
        (
            "loss.importance_level=tokens",
            "loss.importance_level must be one of ('token', 'sequence')",
        ),
        ("loss.overlong_penalty=-1", "loss.overlong_penalty must be >= 0"),
        (
            "rollout.dynamic_sampling=true rollout.num_generations=1",
            "rollout.num_generations must be >= 2, got 1",
        ),
        (
            "rollout.max_resample_rounds=-1",
            "rollout.max_resample_rounds must be >= 0, got -1",
        ),
    ],
)
def test_bad_loss_input_is_one_line_naming_the_field_and_exit_2(
    override, message, tmp_path, capsys
):
  out = tmp_path / "out"
  args = ["train", "--preset=smoke", "--no-progress", f"--out={out}"]
  args += override.split()
  assert cli_main(args) == 2
  err = capsys.readouterr().err
  assert err.startswith("logra train: error: ") and err.count("\n") == 1, err
  assert message in err
  assert not out.exists()


def test_gspo_at_the_token_level_is_refused_naming_the_field():
  with pytest.raises(ValueError, match="^loss.importance_level='token' does"):
    configs.LossConfig(policy_loss="gspo", importance_level="token")
  config = configs.LossConfig(policy_loss="cispo", importance_level="sequence")
  assert config.importance_level == "sequence"
