"""`quant/microscaling.py` and `microscaling_quantize.py` (FP4 e2m1 values, e8m0 scales) against `ml_dtypes`' float4_e2m1fn / float8_e8m0fnu and
against transformers 5.24's own unpacking (`Fp8Dequantize._dequantize_one`, recorded by
`scripts/transformers_v4_reference.py` in `tests/data/v4/transformers_fp4_unpacking.npz`)."""

import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from quant import errors
from quant import fp8
from quant import microscaling as ms
from quant import microscaling_quantize as mq

from conftest import DATA as DATA_DIR
DATA = os.path.join(DATA_DIR, "v4")
F4, E8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu


def _values() -> np.ndarray:
  """Every tie, threshold neighbour and code value, both signs, zeros, beyond the range, and random values."""
  edges = np.array([0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, 7, 1e9, 3e38, *ms.E2M1_VALUES[:8]], np.float32)
  near = np.concatenate([np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(0)), edges])
  rng = np.random.default_rng(0)
  sample = np.concatenate([near, rng.uniform(0, 8, 20000).astype(np.float32),
                           np.abs(rng.standard_normal(5000)).astype(np.float32) * 2])
  return np.concatenate([sample, -sample])


def test_e2m1_encoding_is_ml_dtypes_cast_for_every_value_ties_and_saturation_included():
  x = _values()
  ours = np.asarray(mq.e2m1_encode(x))
  theirs = x.astype(F4).view(np.uint8)
  assert np.array_equal(ours, theirs)
  assert np.array_equal(ms.e2m1_decode(np.arange(16, dtype=np.uint8)), np.arange(16, dtype=np.uint8).view(F4)
                        .astype(np.float32))
  assert np.asarray(mq.e2m1_encode(np.float32(1e30))) == 7 and np.asarray(mq.e2m1_encode(np.float32(-9))) == 15


def test_e8m0_codes_are_ml_dtypes_bytes_and_scales_round_up_to_a_power_of_two():
  codes = np.arange(256, dtype=np.uint8)
  decoded = ms.e8m0_decode(codes)
  expected = codes.view(E8).astype(np.float32)
  assert np.array_equal(decoded[:255], expected[:255]) and np.isnan(decoded[255]) and np.isnan(expected[255])
  rng = np.random.default_rng(1)
  scales = np.concatenate([np.exp2(rng.uniform(-126, 126, 5000)).astype(np.float32),
                           np.exp2(np.arange(-126, 127)).astype(np.float32)])
  up = np.asarray(mq.pow2_ceil(scales))
  assert (up >= scales).all() and (up < 2 * scales).all()  # the smallest power of two at or above
  assert np.array_equal(np.asarray(mq.e8m0_encode(up)), up.astype(E8).view(np.uint8))  # exact powers: ml_dtypes
  assert np.array_equal(ms.e8m0_decode(np.asarray(mq.e8m0_encode(up))), up)
  # Tiny scales are raised to 2^-126 (byte 1); a zero block gets scale 1 (byte 127).
  assert np.asarray(mq.e8m0_encode(mq.pow2_ceil(np.float32(1e-42)))) == 1
  assert np.asarray(mq.group_scales(np.float32(0.0), ms.E2M1_MAX)) == 1.0


def test_fp4_quantization_is_per_32_values_with_power_of_two_scales_and_is_exact_where_representable():
  rng = np.random.default_rng(2)
  w = rng.standard_normal((6, 96)).astype(np.float32)
  w[1, :32] = 0  # a zero group
  w[2, 32:64] = np.float32(3e-38)  # absmax / 6 below 2^-126: the scale is raised to 2^-126
  packed, codes = (np.asarray(a) for a in mq.fp4_quantize(w))
  assert packed.shape == (6, 48) and codes.shape == (6, 3) and packed.dtype == codes.dtype == np.uint8
  groups = w.reshape(6, 3, 32)
  scale = ms.e8m0_decode(codes)
  amax = np.abs(groups).max(-1)
  nonzero = amax > 0
  ordinary = nonzero & (amax > 6 * 2.0**-126)
  assert (amax[ordinary] / scale[ordinary] <= 6).all() and (amax[ordinary] / scale[ordinary] > 3).all()
  assert codes[1, 0] == 127 and codes[2, 1] == 1
  # Element by element, the values ml_dtypes' e2m1 cast of w / scale gives, packed low nibble first.
  expected = (groups / scale[..., None]).reshape(6, 96).astype(F4).view(np.uint8)
  assert np.array_equal(packed, expected[:, 0::2] | (expected[:, 1::2] << 4))
  back = ms.fp4_dequantize(packed, codes)
  assert np.array_equal(back, expected.view(F4).astype(np.float32) * np.repeat(scale, 32, -1))
  exact = (np.repeat(scale, 32, -1) * ms.E2M1_VALUES[rng.integers(0, 16, (6, 96))])[[0, 1, 3, 4, 5]]  # normal floats
  assert np.array_equal(ms.fp4_dequantize(*(np.asarray(a) for a in mq.fp4_quantize(exact))), exact)


def test_fp4_refuses_what_it_cannot_encode():
  with pytest.raises(errors.QuantError, match="multiple of 32"):
    mq.fp4_quantize(np.zeros((2, 48), np.float32))
  with pytest.raises(errors.QuantError, match="NaN or inf"):
    ms.check_finite(np.array([1.0, np.nan], np.float32), "w")


def test_power_of_two_fp8_blocks_never_saturate_and_dequantize_exactly_by_their_scale():
  rng = np.random.default_rng(3)
  w = (rng.standard_normal((300, 200)) * 0.05).astype(np.float32)
  q, scale = (np.asarray(a) for a in fp8.block_quantize(jnp.asarray(w), (128, 128), "float8_e4m3fn",
                                                         power_of_two=True))
  exponent = np.frexp(scale)[0]
  assert (exponent == 0.5).all()  # powers of two
  plain = np.asarray(fp8.block_quantize(jnp.asarray(w), (128, 128), "float8_e4m3fn")[1])
  assert (scale >= plain).all() and (scale < 2 * plain).all()
  full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:300, :200]
  assert np.array_equal(q, (w / full).astype(ml_dtypes.float8_e4m3fn))  # no clipping: |w| / scale <= 448
  assert np.abs(q.astype(np.float32)).max() <= 448


def test_transformers_unpacks_our_packed_bytes_to_our_values():
  """transformers 5.24's FP4 dequantization (`Fp8Dequantize._dequantize_one`, int8 weight, float8_e8m0fnu scales)
  of bytes and scales we packed, recorded by the reference script, equals our decoding, bit for bit."""
  recorded = np.load(os.path.join(DATA, "transformers_fp4_unpacking.npz"))
  packed, codes = recorded["packed"], recorded["scale_codes"]
  assert packed.dtype == np.int8 and codes.dtype == np.uint8
  assert np.array_equal(ms.fp4_dequantize(packed, codes), recorded["transformers"])
  # The script's bytes are every byte value in every scale: the full table of both nibbles.
  assert sorted(set(packed.view(np.uint8).ravel().tolist())) == list(range(256))
