"""One process of the 2-process x 4-CPU-device run in test_sharding.py.

Usage: python multiprocess_worker.py PROCESS_ID PORT OUT.npz
"""

import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_default_matmul_precision", "highest")

from logra_jax import parallel  # noqa: E402


def main():
  process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  parallel.initialize(
      f"localhost:{port}", num_processes=2, process_id=process_id
  )
  assert jax.process_count() == 2 and len(jax.devices()) == 8

  from jax.experimental import multihost_utils
  import numpy as np
  import test_sharding as case  # the same model, batch and optimizer

  from logra_jax import models
  from logra_jax.rl import learner

  mesh = parallel.make_mesh(parallel.MeshConfig.parse(sys.argv[4]))
  graphdef, params = models.split_model(models.init_model(case.CONFIG, 0))
  tx = learner.make_optimizer(case.RUN.optimizer, params)
  batch = case._batch()
  params_sharding = parallel.param_shardings(params, mesh)
  state_sharding = parallel.optimizer_state_shardings(
      tx, params, params_sharding, mesh
  )
  weights_sharding = parallel.weight_shardings(
      learner.abstract_weights(case.RUN.optimizer, tx, params),
      params_sharding,
      mesh,
  )
  batch_sharding = parallel.data_shardings(batch, mesh)
  step = learner.make_train_step(
      graphdef,
      tx,
      case.RUN,
      shardings=(weights_sharding, state_sharding, batch_sharding),
      activation_rules=parallel.PARTITION_RULES,
  )
  params, state = learner.init_train_state(case.RUN.optimizer, tx, params)
  state = jax.tree.map(parallel.global_array, state, state_sharding)
  params = jax.tree.map(parallel.global_array, params, weights_sharding)
  batch = jax.tree.map(parallel.global_array, batch, batch_sharding)
  for _ in range(3):
    params, state, metrics = step(params, state, batch)
  gathered = multihost_utils.process_allgather(
      learner.dense_weights(params, state), tiled=True
  )
  if process_id == 0:
    leaves = {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(gathered)[0]
    }
    leaves["loss"] = np.asarray(metrics["loss"].addressable_data(0))
    np.savez(out, **leaves)


if __name__ == "__main__":
  main()
