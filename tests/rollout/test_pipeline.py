"""The rollout pipeline: the default job with the engine in its own process
equals the colocated one (which shares the learner's arrays); asynchronous
rollouts (``rollout.max_staleness``): the engine samples ahead while the
learner trains, each batch at most that many policy versions behind, and a
checkpoint resumes from the first batch not trained on."""

import json

import jax
import numpy as np
import pytest

from logra_jax import parallel
from logra_jax import sync
from logra_jax import configs
from logra_jax.rl import trainer

SMOKE = configs.get_preset("smoke")
QUIET = lambda message: None


def test_one_step_off_policy_run(policy_folder, tmp_path):
  config = configs.apply_overrides(
      SMOKE,
      [f"policy.path={policy_folder}", "steps=3", "rollout.max_staleness=1"],
  )
  summary = trainer.train(config, tmp_path, progress=False, log=lambda s: None)
  rows = [
      json.loads(line)
      for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  # The first batch is sampled with the initial weights; every later one
  # while the step before it trained, one version behind.
  assert [r["rollout/version_lag"] for r in rows] == [0.0, 1.0, 1.0]
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert summary["steps"] == 3
  # The checkpoint resumes at the batch the engine sampled ahead (drawn,
  # never trained on): the data position and key of the synchronous loop.
  loop = json.loads(
      (tmp_path / "checkpoints" / "3" / "loop" / "metadata").read_text()
  )
  key = jax.random.key(config.seed)
  for _ in range(3):
    key, _ = jax.random.split(key)
  assert loop["data_position"] == 3
  assert loop["key"]["data"] == np.asarray(jax.random.key_data(key)).tolist()


@pytest.mark.parametrize(
    "overrides, mesh, match",
    [
        (["rollout.max_staleness=-1"], None, "rollout.max_staleness must be"),
        (
            ["rollout.max_staleness=1"],
            parallel.MeshConfig(fsdp=2),
            "needs the engine in its own process",
        ),
    ],
)
def test_bad_staleness_settings_are_refused_before_the_run(
    overrides, mesh, match, tmp_path
):
  with pytest.raises(ValueError, match=match):
    config = configs.apply_overrides(SMOKE, overrides)
    trainer.train(config, tmp_path / "run", progress=False, mesh=mesh)
  assert not (tmp_path / "run").exists()


def test_a_refused_sync_is_followed_by_a_full_one(
    policy_folder, tmp_path, monkeypatch
):
  """Message 2 is lost on the way (refused); message 3 then no longer fits
  either. Once the requests before them are done, the learner sends one
  full message, and the run goes on."""
  apply = sync.PolicyReceiver.apply

  def lossy(self, message):
    if message.sequence == 2 and not message.full:
      raise sync.SyncError("damaged on the way")
    return apply(self, message)

  monkeypatch.setattr(sync.PolicyReceiver, "apply", lossy)
  config = configs.apply_overrides(
      SMOKE,
      [f"policy.path={policy_folder}", "steps=4", "rollout.max_staleness=1"],
  )
  trainer.train(config, tmp_path, progress=False, log=lambda s: None)
  rows = [
      json.loads(line)
      for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  assert len(rows) == 4
  assert rows[-1]["sync/resyncs"] == 1.0


def test_the_default_job_in_a_process_matches_the_colocated_one(
    policy_folder, tmp_path
):
  runs = {}
  for engine in ("colocated", "process"):
    config = configs.apply_overrides(
        SMOKE,
        [
            f"policy.path={policy_folder}",
            f"rollout.engine={engine}",
            "sync.resync_every=2",
        ],
    )
    summary = trainer.train(
        config, tmp_path / engine, progress=False, log=QUIET
    )
    rows = [
        json.loads(line)
        for line in (tmp_path / engine / "metrics.jsonl").open()
    ]
    runs[engine] = summary, [
        {
            k: v
            for k, v in row.items()
            if not k.startswith(("time/", "compile/"))
        }
        for row in rows
    ]
  (colocated, colocated_rows), (process, process_rows) = runs.values()
  # The colocated engine samples with the learner's arrays: nothing sent.
  assert all(row["sync/bytes"] == 0 for row in colocated_rows)
  numbers = lambda rows: [
      {k: v for k, v in row.items() if not k.startswith("sync/")}
      for row in rows
  ]
  assert numbers(process_rows) == numbers(colocated_rows)
  for key in ("eval_accuracy_before", "eval_accuracy_after"):
    assert process[key] == colocated[key]
  # sync.resync_every=2: step 2's message is a full one.
  full_bytes = [row["sync/bytes"] for row in process_rows]
  assert full_bytes[1] > full_bytes[0] and full_bytes[1] > full_bytes[2]
  assert all(row["sync/resyncs"] == 0 for row in process_rows)
