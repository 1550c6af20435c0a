"""Device mesh, the partition table, the one logical -> mesh mapper, activation
constraints and multi-host start-up."""

from logra_jax.parallel.distributed import barrier
from logra_jax.parallel.distributed import check_same_everywhere
from logra_jax.parallel.distributed import gather_rows
from logra_jax.parallel.distributed import global_array
from logra_jax.parallel.distributed import host_value
from logra_jax.parallel.distributed import initialize
from logra_jax.parallel.distributed import is_leader
from logra_jax.parallel.distributed import join_from_environment
from logra_jax.parallel.distributed import launched_process_id
from logra_jax.parallel.distributed import process_rows
from logra_jax.parallel.distributed import sum_over_processes
from logra_jax.parallel.sharding import batch_sharding
from logra_jax.parallel.sharding import data_shardings
from logra_jax.parallel.sharding import activation_sharding
from logra_jax.parallel.sharding import constrain
from logra_jax.parallel.sharding import logical_to_mesh
from logra_jax.parallel.sharding import make_mesh
from logra_jax.parallel.sharding import MESH_AXES
from logra_jax.parallel.sharding import MeshConfig
from logra_jax.parallel.sharding import optimizer_state_shardings
from logra_jax.parallel.sharding import param_shardings
from logra_jax.parallel.sharding import PARTITION_RULES
from logra_jax.parallel.sharding import weight_shardings
