"""Fits a small MLP with LoGRA and with dense Adam and prints both losses.

Run: python experiments/quickstart.py
"""

import time

import jax
import jax.numpy as jnp
import optax

import logra_jax as logra


def main(steps: int = 300) -> None:
  k_x, k_w, k_init = jax.random.split(jax.random.key(0), 3)
  x_NxD = jax.random.normal(k_x, (512, 64))
  y_N = jnp.tanh(x_NxD @ jax.random.normal(k_w, (64,)) / 8.0)
  k1, k2 = jax.random.split(k_init)
  params = {"w1": jax.random.normal(k1, (64, 256)) / 8.0, "b1": jnp.zeros(256),
            "w2": jax.random.normal(k2, (256, 1)) / 16.0}

  def loss_fn(p):
    h_NxH = jax.nn.gelu(x_NxD @ p["w1"] + p["b1"])
    return jnp.mean(((h_NxH @ p["w2"])[:, 0] - y_N) ** 2)

  print(f"{'optimizer':<22} {'loss@0':>9} {'loss@end':>9} {'state bytes':>12}"
        f" {'seconds':>8}")
  for name, tx in (("adam", optax.adam(3e-3)),
                   ("logra rank 8 (range)", logra.logra(3e-3, rank=8,
                                                        refresh_every=50))):
    state = tx.init(params)

    @jax.jit
    def step(p, s):
      loss, grads = jax.value_and_grad(loss_fn)(p)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s, loss

    p, start = params, time.perf_counter()
    first = None
    for _ in range(steps):
      p, state, loss = step(p, state)
      first = float(loss) if first is None else first
    print(f"{name:<22} {first:>9.5f} {float(loss_fn(p)):>9.5f} "
          f"{logra.optimizer_state_bytes(state):>12,d} "
          f"{time.perf_counter() - start:>8.2f}")


if __name__ == "__main__":
  main()
