"""Environments by name or path: bad ones are refused in one line, before a
run compiles anything or creates its folder."""

import textwrap

import pytest

from logra_jax import cli
from logra_jax import configs
from logra_jax import envs

SMOKE = configs.get_preset("smoke")

GOOD = """
import threading

from logra_jax import envs

class Echo:
  def reset(self, example):
    return [{"role": "user", "content": example["prompt"]}]

  def step(self, model_message):
    return envs.StepResult([{"role": "user", "content": "again"}])

def echo():
  return Echo()

not_callable = 3

def no_step():
  return object()

def raises():
  raise RuntimeError("no server")

def hangs():
  threading.Event().wait()
"""


@pytest.fixture
def module_file(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "my_env.py").write_text(textwrap.dedent(GOOD))
  (tmp_path / "broken.py").write_text("import no_such_module_here\n")
  (tmp_path / "stuck.py").write_text(
      "import threading\nthreading.Event().wait()\n"
  )
  return tmp_path / "my_env.py"


def test_a_factory_loads_by_file_path_and_by_shipped_name(module_file):
  env = envs.load_environment("my_env.py:echo")()
  assert env.step("hi").messages == [{"role": "user", "content": "again"}]
  assert envs.load_environment("calculator") is envs.SHIPPED["calculator"]
  assert (
      envs.load_environment("logra_jax.envs.calculator:calculator")
      is envs.SHIPPED["calculator"]
  )


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("nothing", ValueError, "must be one of"),
        ("missing.py:echo", FileNotFoundError, "missing.py not found"),
        ("broken.py:echo", ValueError, "does not import: ModuleNotFound"),
        ("no_such_package_here:f", ValueError, "does not import"),
        ("my_env.py:absent", ValueError, "has no attribute 'absent'"),
        ("my_env.py:not_callable", ValueError, "int is not callable"),
        ("my_env.py:no_step", ValueError, "object without reset and step"),
        ("my_env.py:raises", ValueError, "RuntimeError: no server"),
    ],
)
def test_a_bad_environment_is_one_line_naming_it(
    module_file, spec, error, message
):
  with pytest.raises(error, match=message) as caught:
    envs.load_environment(spec)
  assert f"task.environment={spec!r}" in str(caught.value)
  assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("stuck.py:echo", "importing stuck.py did not finish within 0.2 s"),
        ("my_env.py:hangs", "the factory did not return within 0.2 s"),
    ],
)
def test_an_environment_that_hangs_before_the_run_is_refused(
    module_file, spec, message
):
  with pytest.raises(ValueError, match=message) as caught:
    envs.load_environment(spec, timeout_s=0.2)
  assert f"task.environment={spec!r}" in str(caught.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.environment=my_env.py:no_step"], "without reset and step"),
        (["task.environment=nothing"], "must be one of"),
        (["rollout.max_turns=2"], "needs an environment"),
        (["rollout.env_timeout_s=0"], "rollout.env_timeout_s must be > 0"),
        (
            ["rollout.env_timeout_s=inf"],
            "rollout.env_timeout_s must be a finite number > 0, got inf",
        ),
        (
            ["task.environment=calculator", "rollout.dynamic_sampling=true"],
            "not supported with task.environment",
        ),
    ],
)
def test_the_cli_refuses_a_bad_environment_before_the_run_starts(
    module_file, capsys, overrides, message
):
  out = module_file.parent / "run"
  sets = [arg for o in overrides for arg in ("--set", o)]
  status = cli.main(["train", "--preset", "smoke", *sets, "--out", str(out)])
  assert status == 2
  assert message in capsys.readouterr().err
  assert not out.exists()
