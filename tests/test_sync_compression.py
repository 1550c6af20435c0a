"""experiments/sync_compression.py's codecs restore every bit, and its tally
against sizes worked out by hand."""

import pathlib
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "experiments"))
import sync_compression  # noqa: E402

# Values a float array may hold whose bits an arithmetic delta would lose:
# signed zeros, infinities, a NaN with a payload, subnormals (float32).
SPECIAL = np.array(
    [0.0, -0.0, np.inf, -np.inf, 1e-45, -3e-39, 1.0, -2.5], np.float32
)
NAN_PAYLOAD = np.array([0x7FC00123], np.uint32).view(np.float32)


# The same for bfloat16, from its bits (a float32 cast would drop the NaN's
# payload and flush the subnormal): +0, -0, +inf, -inf, the smallest
# subnormal, a negative subnormal, a NaN with a payload, 1, -2.5.
SPECIAL_BF16 = np.array(
    [0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x8070, 0x7FC1, 0x3F80, 0xC020],
    np.uint16,
).view(ml_dtypes.bfloat16)


def _arrays():
  rng = np.random.default_rng(0)
  floats = np.concatenate([SPECIAL, NAN_PAYLOAD, rng.normal(size=23)])
  return [
      floats.astype(np.float32).reshape(4, 8),
      np.concatenate([SPECIAL_BF16, rng.normal(size=7).astype("bfloat16")]),
      rng.integers(0, 256, size=(3, 5), dtype=np.uint8),
      rng.integers(-8, 8, size=7).astype(np.int8),
      np.array(-0.0, np.float32),  # a scalar
  ]


def _same_bits(a, b):
  return np.array_equal(sync_compression._bits(a), sync_compression._bits(b))


@pytest.mark.parametrize("form", ["raw", "shuffle", "xor"])
@pytest.mark.parametrize("index", range(5))
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


def test_the_tally_counts_bytes_per_kind_and_message_as_worked_out():
  x = np.linspace(-1, 1, 256, dtype=np.float32)
  norm = x[:64]
  first = {"['layers']['q'].coords": x, "['norm']": norm}
  second = {"['layers']['q'].coords": x * 1.001, "['norm']": norm}
  tally = sync_compression.Tally()
  tally.add(first, {})
  tally.add(second, first)
  summary = tally.summary()
  assert set(summary) == {"coords", "dense"}
  assert summary["coords"]["raw_bytes_per_step"] == 256 * 4
  assert summary["dense"]["raw_bytes_per_step"] == 64 * 4
  # Per message, zlib of each kind's bytes as they are:
  zlib_of = lambda a: len(zlib.compress(a.tobytes(), 6))
  assert tally.steps[0]["zlib"] == (1280, zlib_of(x) + zlib_of(norm))
  assert tally.steps[1]["zlib"] == (1280, zlib_of(x * 1.001) + zlib_of(norm))
  # The dense leaf repeats: the first message XORs it with nothing (its
  # shuffled bytes), the second with itself (256 zero bytes).
  packed = lambda s: tally.packed["dense", s]
  shuffled = len(zlib.compress(sync_compression.shuffled(norm), 6))
  assert packed("shuffle+zlib") == 2 * shuffled
  assert packed("xor+shuffle+zlib") == shuffled + len(
      zlib.compress(bytes(256), 6)
  )
  ratios = [raw / packed for raw, packed in (m["zlib"] for m in tally.steps)]
  assert tally.spread()["zlib"] == [min(ratios), np.median(ratios), max(ratios)]


def test_a_refresh_projector_is_tallied_apart_from_the_step():
  x = np.linspace(-1, 1, 64, dtype=np.float32)
  tally = sync_compression.Tally()
  tally.add({"['norm']": x, "projector:['layers']['q']": np.ones(512)}, {})
  assert tally.summary()["projector"]["raw_bytes_per_step"] == 512 * 8
  assert tally.steps[0]["zlib"][0] == 64 * 4  # the step's bytes alone


def test_totals_over_kinds_as_worked_out():
  """1000 bytes of coordinates at ratio 2 and 500 of dense leaves at ratio
  1, compressed at 1 and 2 MB/s and restored at 2 and 4: 1500 bytes
  become 1000, in 1e-3 / 1 + 1e-3 / 2 + 5e-4 / 2 + 5e-4 / 4 = 1.875e-3 s;
  compressing pays below 500 / 1.875e-3 bytes/s. The projectors of a
  refresh are left out."""
  rates = lambda ratio, there, back: {
      "ratio": ratio,
      "compress_mb_s": there,
      "decompress_mb_s": back,
  }
  summary = {
      "coords": {"raw_bytes_per_step": 1000.0, "zlib": rates(2.0, 1.0, 2.0)},
      "dense": {"raw_bytes_per_step": 500.0, "zlib": rates(1.0, 2.0, 4.0)},
      "projector": {"raw_bytes_per_step": 9e9, "zlib": rates(1.0, 1.0, 1.0)},
  }
  total = sync_compression.totals(summary, "zlib")
  assert total["raw"] == 1500 and total["packed"] == 1000
  assert total["seconds"] == pytest.approx(1.875e-3)
  assert total["break_even_bytes_s"] == pytest.approx(500 / 1.875e-3)
  summary["coords"]["zlib"]["ratio"] = 0.5  # compressing grows it: never
  assert sync_compression.totals(summary, "zlib")["break_even_bytes_s"] == 0


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
