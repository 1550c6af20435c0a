"""Config files are bounded before they are expanded: an alias bomb, deep
nesting, a complex key, a recursive alias and an oversized file are each
refused in one line naming the file (exit 2), before --out exists."""

import pytest

from logra_jax import configs
from logra_jax.cli import main as cli_main
from logra_jax.configs import loading


def _bomb(levels: int, width: int) -> str:
  """An alias bomb: ``width ** levels`` values in a few hundred bytes."""
  lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
  for i in range(1, levels):
    items = ", ".join([f"*a{i - 1}"] * width)
    lines.append(f"a{i}: &a{i} [{items}]")
  return "\n".join(lines) + "\n"


CASES = {
    "bomb": (_bomb(9, 9), f"more than {loading.MAX_NODES} values"),
    "deep": ("task: " + "[" * 5000 + "]" * 5000, "nested deeper than 64"),
    "sequence-key": ("? [a, b]\n: 1\n", "a key must be text or a number"),
    "mapping-key": ("{a: 1}: 2\n", "not a mapping (line 1, column 1)"),
    "recursive": ("a: &a [*a]\n", "an alias inside the value it names"),
    "large": ("#" * (loading.MAX_FILE_BYTES + 1), "larger than"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hostile_config_file_is_one_line_exit_2(name, tmp_path, capsys):
  text, message = CASES[name]
  path = tmp_path / f"{name}.yaml"
  path.write_text(text)
  out = tmp_path / "run"
  assert cli_main(["train", f"--config={path}", f"--out={out}"]) == 2
  error = capsys.readouterr().err
  assert error.count("\n") == 1, error
  assert f"config file {path} is " in error and message in error, error
  assert not out.exists()


def test_anchors_and_aliases_within_the_bounds_still_work(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text(
      "optimizer: &opt {rank: 8}\n"
      "rewards: [&r {function: task, weight: 0.5}, *r]\n"
  )
  config = configs.load_config("smoke", [path])
  assert config.optimizer.rank == 8
  assert [r.weight for r in config.rewards] == [0.5, 0.5]
