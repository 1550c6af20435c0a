"""Setting up a run: inputs that cannot work are refused before anything is
written."""

import jax
import pytest

from logra_jax import configs
from logra_jax.rl import setup

SMOKE = configs.get_preset("smoke")


def test_a_process_engine_with_several_processes_is_refused(
    policy_folder, tmp_path, monkeypatch
):
  """One engine process serves one learner process; a multi-process run
  samples with the colocated engine (each process its own rows)."""
  config = configs.apply_overrides(
      SMOKE, [f"policy.path={policy_folder}", "rollout.engine=process"]
  )
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match="several processes"):
    setup.check_inputs(config, tmp_path / "run", None, resume=False)
  assert not (tmp_path / "run").exists()
