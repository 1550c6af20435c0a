"""`logra` on bad input: one line on stderr, exit status 2, nothing written;
a full disk in one line, exit status 1; the exit status of a run stopped by
a signal."""

import subprocess
import sys

import pytest

from logra_jax import checkpoint
from logra_jax import parallel
from logra_jax.cli import main as cli_main
from logra_jax import configs
from logra_jax.rl import trainer
from logra_jax.rollout import transport


def _one_line_error(capsys, command: str) -> str:
  err = capsys.readouterr().err
  assert err.startswith(f"logra {command}: error: "), err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  return err


def _run_folder(folder):
  """What a training run leaves: its config and checkpoints."""
  (folder / "checkpoints").mkdir(parents=True)
  (folder / "config.yaml").write_text(
      configs.to_yaml(configs.get_preset("smoke"))
  )
  return folder


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--set=optimizer.learning_rate=nan"],
            "optimizer.learning_rate must be a finite number > 0, got nan",
        ),
        (["--set=optimizer.b1=5"], "optimizer.b1 must be in [0, 1), got 5.0"),
        (["--set=optimizer.kind=bogus"], "optimizer.kind must be one of"),
        (
            ["--set=optimizer.moment_policy=bogus"],
            "optimizer.moment_policy must be one of",
        ),
        (["--set=rollout.top_k=-5"], "rollout.top_k must be >= 0, got -5"),
        (["--set=policy.num_heads=3"], "policy.num_heads=3 must divide"),
        (["--set=seed=-1"], "seed must be in [0, 9223372036854775807], got -1"),
        (
            ["--set=policy.attention=flash"],
            "policy.attention must be one of ('auto', 'chunked', 'xla', "
            "'cudnn'), got 'flash'",
        ),
        (
            ["--set=policy.remat=full"],
            "policy.remat must be one of ('none', 'block', 'dots_saveable'), "
            "got 'full'",
        ),
        (
            ["--set=policy.attention=cudnn"],
            "policy.attention='cudnn' runs on GPUs with a bfloat16 or float16 "
            "compute dtype; here the platform is cpu and the dtype float32",
        ),
        (
            ["--mesh=fsdp=8,fsdp=1"],
            "mesh entry 'fsdp=1': axis fsdp is given twice (already fsdp=8)",
        ),
        (
            [
                "--mesh=fsdp=8",
                "--set=optimizer.target_kl=0.01",
                "--set=optimizer.kl_subsample=4",
            ],
            "optimizer.kl_subsample=4 is not divisible by the mesh's data "
            "axes (8 devices)",
        ),
        (
            ["--set=policy.path={tmp}/missing"],
            "policy folder {tmp}/missing does not exist",
        ),
        (
            ["--set=policy.path={tmp}"],
            "policy folder {tmp} holds no config.json",
        ),
        (
            ["--set=policy.path={tmp}/run"],
            "is the folder of a training run, not "
            "a policy: write its policy as a Hugging Face folder with `logra export",
        ),
        (["--resume"], "nothing to resume in {tmp}/out"),
        (
            ["--set=task.size=2000000000"],
            "task.size must be <= 1000000, got 2000000000",
        ),
        (["--set=task.template={{0}}"], "field {{0}} must be the name of a"),
        (["--set=task.template={{prompt.nope}}"], "field {{prompt.nope}} must"),
        (["--set=task.template={{prompt[99]}}"], "field {{prompt[99]}} must"),
        (["--set=task.template={{prompt"], "is not a format string"),
        (
            ["--set=task.template={{prompt:d}}"],
            "prompt template '{{prompt:d}}' cannot format tiny items",
        ),
        (
            ["--set=task.options={{max_terms: abc}}"],
            "invalid config {{'min_terms': 3, 'max_terms': 'abc', ",
        ),
    ],
)
def test_bad_train_input_is_one_line_and_writes_nothing(
    args, message, tmp_path, capsys
):
  _run_folder(tmp_path / "run")
  out = tmp_path / "out"
  args = [a.format(tmp=tmp_path) for a in args]
  assert (
      cli_main(
          ["train", "--preset=smoke", "--no-progress", f"--out={out}", *args]
      )
      == 2
  )
  assert message.format(tmp=tmp_path) in _one_line_error(capsys, "train")
  assert not out.exists()


@pytest.mark.parametrize(
    "policy, message",
    [
        ("{tmp}/missing", "policy folder {tmp}/missing does not exist"),
        (
            "{tmp}/run/config.yaml",
            "policy folder {tmp}/run/config.yaml is a " "file, not a folder",
        ),
        (
            "{tmp}/run",
            "{tmp}/run is the folder of a training run, not a policy: "
            "write its policy as a Hugging Face folder with `logra export "
            "--checkpoint {tmp}/run --out <folder>`",
        ),
    ],
)
def test_eval_of_a_folder_that_is_no_policy_is_one_line(
    policy, message, tmp_path, capsys
):
  _run_folder(tmp_path / "run")
  assert (
      cli_main(
          ["eval", "--preset=smoke", f"--policy={policy.format(tmp=tmp_path)}"]
      )
      == 2
  )
  assert message.format(tmp=tmp_path) in _one_line_error(capsys, "eval")


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(2, "No such file or directory", "a/b"),
        NotADirectoryError(20, "Not a directory", "a/file"),
        IsADirectoryError(21, "Is a directory", "a/folder"),
        PermissionError(13, "Permission denied", "a/locked"),
    ],
)
def test_os_errors_about_paths_are_one_line(error, monkeypatch, capsys):
  def export_policy(*args, **kwargs):
    raise error

  monkeypatch.setattr(checkpoint, "export_policy", export_policy)
  assert cli_main(["export", "--checkpoint=a", "--out=b"]) == 2
  assert f"'{error.filename}'" in _one_line_error(capsys, "export")


def test_a_dead_rollout_engine_is_one_line_and_a_failed_run(
    monkeypatch, capsys
):
  def train(*args, **kwargs):
    raise transport.TransportError(
        "the rollout engine process exited with code -9 (log: "
        "runs/x/rollout_engine.log)"
    )

  monkeypatch.setattr(trainer, "train", train)
  assert cli_main(["train", "--preset", "smoke", "--no-progress"]) == 1
  assert "exited with code -9" in _one_line_error(capsys, "train")


# A run whose trainer raises ``error`` (a full disk, or a failed checkpoint
# save seen as the run closes its checkpoints) while a library's exit hook
# (as tensorboardX's and orbax's do) would retry a failed write.
_FAILED_WRITE_RUN = """
import atexit, errno, sys
from logra_jax import checkpoint, cli
from logra_jax.rl import trainer

def save_error(errno_):
  error = checkpoint.CheckpointSaveError("saving a checkpoint in c failed: x")
  error.errno = errno_
  return error

def train(*args, **kwargs):
  raise {error}

trainer.train = train
atexit.register(lambda: print("Traceback: a write retried at exit", file=sys.stderr))
sys.exit(cli.main(["train", "--preset", "smoke", "--no-progress", "--out", sys.argv[1]]))
"""


@pytest.mark.parametrize(
    "error, line",
    [
        (
            'OSError(errno.ENOSPC, "No space left on device")',
            "logra train: error: the disk is full",
        ),
        ("save_error(errno.ENOSPC)", "logra train: error: the disk is full"),
        (
            "save_error(None)",
            "logra train: error: saving a checkpoint in c failed",
        ),
    ],
)
def test_a_failed_write_is_one_line_and_a_failed_run(error, line, tmp_path):
  done = subprocess.run(
      [
          sys.executable,
          "-c",
          _FAILED_WRITE_RUN.format(error=error),
          str(tmp_path / "run"),
      ],
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert done.returncode == 1, done.stderr
  assert done.stderr.startswith(line), done.stderr
  assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize(
    "stopped_by, status", [(None, 0), ("SIGTERM", 143), ("SIGINT", 130)]
)
def test_a_run_stopped_by_a_signal_exits_with_its_status(
    stopped_by, status, monkeypatch, tmp_path
):
  # The trainer saves and returns the summary; the status tells the shell
  # (and a scheduler) which signal stopped it. The real signal is sent to a
  # run in tests/rl/test_trainer.py.
  monkeypatch.setattr(
      trainer, "train", lambda *args, **kwargs: {"stopped_by": stopped_by}
  )
  assert cli_main(["train", "--preset=smoke", f"--out={tmp_path}"]) == status


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "fsdp=8,fsdp=1",
            "mesh entry 'fsdp=1': axis fsdp is given twice (already fsdp=8)",
        ),
        ("dp=2,tp=2,dp=2", "mesh entry 'dp=2': axis dp is given twice"),
        ("fsdp=0", "mesh entry 'fsdp=0': size must be a positive int"),
        ("tp=-2", "mesh entry 'tp=-2': size must be a positive int"),
        ("pp=2", "mesh entry 'pp=2': expected axis=size with axis in"),
        ("fsdp", "mesh entry 'fsdp': expected axis=size"),
        ("fsdp=2=2", "mesh entry 'fsdp=2=2': size must be an int"),
        ("fsdp=", "mesh entry 'fsdp=': size must be an int"),
        ("fsdp=1_0", "mesh entry 'fsdp=1_0': size must be an int"),
        ("fsdp=8.0", "mesh entry 'fsdp=8.0': size must be an int"),
    ],
)
def test_bad_mesh_entries_are_refused_naming_the_entry(text, message):
  with pytest.raises(ValueError) as info:
    parallel.MeshConfig.parse(text)
  assert str(info.value).startswith(message)


def test_mesh_entries_may_have_spaces():
  assert parallel.MeshConfig.parse(" dp = 2, fsdp=4 ") == parallel.MeshConfig(
      dp=2, fsdp=4
  )


def test_allow_reshard_without_resume_is_refused_before_the_run(
    tmp_path, capsys
):
  out = tmp_path / "run"
  assert (
      cli_main(["train", "--preset=smoke", "--allow-reshard", f"--out={out}"])
      == 2
  )
  assert "--allow-reshard applies only with --resume" in capsys.readouterr().err
  assert not out.exists()


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "abc"])
def test_device_memory_must_be_a_finite_positive_number(value, capsys):
  with pytest.raises(SystemExit) as info:
    cli_main(["memory", "--model=qwen2.5-0.5b", f"--device-memory-gib={value}"])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert (
      f"--device-memory-gib: expected a finite number > 0, got {value!r}" in err
  )


@pytest.mark.parametrize(
    "flag, value, bounds",
    [
        ("--seq", "0", "[2, 4194304]"),
        ("--seq", "1000000000", "[2, 4194304]"),
        ("--seq", "1_0", "[2, 4194304]"),
        ("--micro-batch", "1000000000", "[1, 65536]"),
        ("--rank", "0", "[1, 65536]"),
        ("--rollout-seqs", "-1", "[0, 1048576]"),
    ],
)
def test_planner_sizes_are_bounded_naming_the_flag(flag, value, bounds, capsys):
  with pytest.raises(SystemExit) as info:
    cli_main(["memory", "--model=qwen2.5-0.5b", f"{flag}={value}"])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert f"argument {flag}: expected an int in {bounds}, got {value!r}" in err


def test_a_planned_mesh_of_too_many_devices_is_refused(capsys):
  # Before any device is made: 100,000 simulated devices took 4 GB.
  assert cli_main(["memory", "--model=qwen2.5-0.5b", "--mesh=fsdp=100000"]) == 2
  assert (
      "the mesh has 100000 devices; the planner compiles for at most 4096"
      in (capsys.readouterr().err)
  )
