"""experiments/sync_compression.py's codecs restore every bit, and its tally
against sizes worked out by hand."""

import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "experiments"))
import sync_compression  # noqa: E402

# Values a float array may hold whose bits an arithmetic delta would lose:
# signed zeros, infinities, a NaN with a payload, subnormals.
SPECIAL = np.array(
    [0.0, -0.0, np.inf, -np.inf, 1e-45, -3e-39, 1.0, -2.5], np.float32
)
NAN_PAYLOAD = np.array([0x7FC00123], np.uint32).view(np.float32)


def _arrays():
  rng = np.random.default_rng(0)
  floats = np.concatenate([SPECIAL, NAN_PAYLOAD, rng.normal(size=23)])
  return [
      floats.astype(np.float32).reshape(4, 8),
      floats.astype(ml_dtypes.bfloat16),
      rng.integers(0, 256, size=(3, 5), dtype=np.uint8),
      rng.integers(-8, 8, size=7).astype(np.int8),
  ]


def _same_bits(a, b):
  return np.array_equal(sync_compression._bits(a), sync_compression._bits(b))


@pytest.mark.parametrize("form", ["raw", "shuffle", "xor"])
@pytest.mark.parametrize("index", range(4))
def test_each_form_is_undone_bit_for_bit(form, index):
  x = _arrays()[index]
  old = np.roll(x.reshape(-1), 1).reshape(x.shape)  # another value, same type
  data = sync_compression.to_bytes(form, x, old)
  assert len(data) == x.nbytes
  back = sync_compression.from_bytes(form, data, x, old)
  assert back.dtype == x.dtype and back.shape == x.shape
  assert _same_bits(back, x)


def test_shuffle_groups_each_values_bytes_by_position():
  # Two float32 values, little-endian bytes [a0 a1 a2 a3] [b0 b1 b2 b3]:
  # shuffled, a0 b0 a1 b1 a2 b2 a3 b3.
  x = np.array([1.0, -2.0], np.float32)
  a, b = x[:1].tobytes(), x[1:].tobytes()
  expected = bytes(v for pair in zip(a, b) for v in pair)
  assert sync_compression.shuffled(x) == expected


def test_an_unchanged_array_xors_to_zero_bytes():
  x = _arrays()[0]
  assert sync_compression.to_bytes("xor", x, x.copy()) == bytes(x.nbytes)


def test_the_tally_counts_raw_bytes_per_kind_and_message():
  x = np.linspace(-1, 1, 256, dtype=np.float32)
  first = {"['layers']['q'].coords": x, "['norm']": x[:64]}
  second = {"['layers']['q'].coords": x * 1.001, "['norm']": x[:64]}
  tally = sync_compression.Tally()
  tally.add(first, {})
  tally.add(second, first)
  summary = tally.summary()
  assert set(summary) == {"coords", "dense"}
  assert summary["coords"]["raw_bytes_per_step"] == 256 * 4
  assert summary["dense"]["raw_bytes_per_step"] == 64 * 4
  # The dense leaf repeats: in the second message its XOR is all zeros, so
  # the XOR scheme compresses it better than the array itself.
  dense = summary["dense"]
  assert dense["xor+shuffle+zlib"]["ratio"] > dense["zlib"]["ratio"]


@pytest.mark.parametrize(
    "name, kind",
    [
        ("['layers']['q_proj'].coords", "coords"),
        ("['layers']['q_proj'].scale", "scale"),
        ("['layers']['q_proj'].codes", "codes"),
        ("['layers']['q_proj'].exponents", "codes"),
        ("projector:['layers']['q_proj']", "projector"),
        ("['embed']", "dense"),
    ],
)
def test_kinds_from_names(name, kind):
  assert sync_compression.kind_of(name) == kind
