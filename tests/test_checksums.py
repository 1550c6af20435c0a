"""Content checksums of arrays: every bit counts, the layout does not, and
arrays are summed in blocks of bounded size."""

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import checksums
from logra_jax import memory


def test_array_checksums_see_every_bit_and_not_the_layout():
  x = jax.random.normal(jax.random.key(0), (4, 8))
  tree = {
      "w": x,
      "half": x.astype(jnp.bfloat16),
      "count": jnp.arange(5),
      "flags": jnp.array([True, False]),
      "scalar": jnp.float32(3.0),
      "empty": jnp.zeros((0, 3)),
  }
  sums = checksums.array_checksums(tree)
  assert sorted(sums) == sorted(tree)
  assert checksums.array_checksums(tree) == sums  # deterministic
  # Each of the 4 * 8 * 32 single-bit flips of w changes w's checksum (the
  # mixing is a bijection of each word, the sum a group operation).
  bits = np.asarray(x).view(np.uint32).reshape(-1)
  for i in range(bits.size):
    for b in range(32):
      flipped = bits.copy()
      flipped[i] ^= np.uint32(1 << b)
      w = jnp.asarray(flipped.view(np.float32).reshape(x.shape))
      assert checksums.array_checksums({"w": w})["w"] != sums["w"], (i, b)
  # Where a value sits counts: two swapped elements differ.
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
  assert checksums.array_checksums({"w": swapped})["w"] != sums["w"]
  # The layout does not: the same array sharded over 8 devices.
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  sharded = jax.device_put(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
  )
  assert checksums.array_checksums({"w": sharded}) == {"w": sums["w"]}


def _numpy_checksum(x: np.ndarray) -> int:
  """The checksum of :func:`checksums.array_checksums` by its definition:
  the sum mod 2**32 of MurmurHash3's finalizer of each 32-bit word XOR its
  flat position times 0x9E3779B9."""
  words = (
      x.reshape(-1)
      .view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)
      .astype(np.uint64)
  )
  h = words ^ ((np.arange(words.size, dtype=np.uint64) * 0x9E3779B9) % 2**32)
  h = ((h ^ (h >> 16)) * 0x85EBCA6B) % 2**32
  h = ((h ^ (h >> 13)) * 0xC2B2AE35) % 2**32
  return int(np.sum(h ^ (h >> 16)) % 2**32)


def test_checksums_are_summed_in_blocks_of_bounded_size():
  x = jax.random.normal(jax.random.key(0), (6, 5, 7))
  for a in (x, x.astype(jnp.bfloat16), x[:1], x[0]):
    expected = _numpy_checksum(np.asarray(a))
    assert checksums.array_checksums({"a": a})["a"] == f"{expected:08x}"
  # Arrays over a block: blocks of rows with a shorter last one (2-d, 1-d),
  # and blocks inside each layer of a stack whose layers are over a block.
  chunk = checksums.CHUNK_WORDS
  for shape in [
      (2 * chunk // 1000 + 7, 1000),
      (3 * chunk + 5,),
      (3, 1100, 1000),
  ]:
    big = jax.random.normal(jax.random.key(1), shape).astype(jnp.bfloat16)
    expected = _numpy_checksum(np.asarray(big))
    assert checksums.array_checksums({"a": big})["a"] == f"{expected:08x}"
  # Temporaries of a block (chunk uint32 words and the mix's), not of the
  # array nor of a layer (compiled as the memory planner compiles on CPU):
  # Qwen2.5-7B's float32 MLP stack and unembedding.
  block = 4 * chunk
  for shape in [(28, 3584, 18944), (3584, 152064)]:
    abstract = jax.ShapeDtypeStruct(shape, jnp.float32)
    temp = memory.compiled_memory(
        checksums.leaf_checksums.lower([abstract])
    ).temp_size_in_bytes
    assert temp <= 2 * block, (shape, temp)
