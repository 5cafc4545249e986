"""FP8 (and int8) numerics: bit-identity with Qwix, scale shapes and edge values, calibrations, DeepSeek block
scales."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix

from quant import errors, fp8

import deepseek_fp8_reference

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _f32(x):
  return np.asarray(x).astype(np.float32)


def _edge_matrix(dtype):
  x = np.random.default_rng(0).normal(size=(8, 16)) * 3
  x[0, 0], x[1, 1], x[2, :], x[3, 3] = np.inf, np.nan, 0.0, 1e6
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_is_bit_identical_to_qwix_including_inf_nan_zero_and_huge_values(dtype):
  x = _edge_matrix(dtype)
  for qtype in (E4M3, E5M2, jnp.int8):
    for calibration in ("absmax", "absmax,0.5", "rms,3", "fixed,10", "fixed,-2,2"):
      for axes in ([0], [1], []):
        expected = qwix.quantize(x, qtype, channelwise_axes=axes, calibration_method=calibration)
        qvalue, scale = fp8.quantize(x, qtype, axes, calibration)
        assert qvalue.dtype == np.dtype(qtype) and scale.dtype == x.dtype
        np.testing.assert_array_equal(_f32(qvalue), _f32(expected.qvalue))
        np.testing.assert_array_equal(_f32(scale), _f32(expected.scale))
        np.testing.assert_array_equal(_f32(fp8.dequantize(qvalue, scale)), _f32(qwix.dequantize(expected)))


def test_int8_scale_is_absmax_over_127_5_and_its_top_bucket_matches_qwix():
  """int8: Qwix's bound 127.5; in bfloat16 a channel's largest value can divide to 128, which rounds and casts as
  Qwix's (measured: -128 appears, +128 saturates to 127); bit for bit on 1M bfloat16 values."""
  x = jnp.asarray(np.random.default_rng(7).normal(size=(4096, 256)), jnp.bfloat16)
  qvalue, scale = fp8.quantize(x, jnp.int8, [1])
  expected = qwix.quantize(x, jnp.int8, channelwise_axes=[1])
  np.testing.assert_array_equal(np.asarray(qvalue), np.asarray(expected.qvalue))
  np.testing.assert_array_equal(_f32(scale), _f32(expected.scale))
  np.testing.assert_allclose(_f32(scale), _f32(jnp.max(jnp.abs(x), axis=0, keepdims=True)) / 127.5, rtol=2 ** -7)
  assert int(np.asarray(qvalue).max()) == 127 and int(np.asarray(qvalue).min()) == -128


def test_scale_keeps_channelwise_axes_and_is_absmax_over_qmax():
  x = np.random.default_rng(1).normal(size=(4, 6, 8)).astype(np.float32)
  qvalue, scale = fp8.quantize(x, E4M3, channelwise_axes=[-1])
  assert qvalue.shape == x.shape and scale.shape == (1, 1, 8)
  np.testing.assert_allclose(scale, np.abs(x).max(axis=(0, 1), keepdims=True) / 448.0, rtol=1e-6)
  _, scale = fp8.quantize(x, E5M2, channelwise_axes=[0, 2])
  assert scale.shape == (4, 1, 8)
  np.testing.assert_allclose(scale, np.abs(x).max(axis=1, keepdims=True) / 57344.0, rtol=1e-6)
  _, scale = fp8.quantize(x, "e4m3")
  assert scale.shape == (1, 1, 1)


def test_all_zero_and_tiny_channels_get_scale_one():
  x = np.ones((3, 5), np.float32)
  x[1] = 0.0
  x[2] = 1e-30  # absmax / 448 is below sqrt(finfo(float32).tiny) ~ 1.1e-19
  qvalue, scale = fp8.quantize(x, E4M3, channelwise_axes=[0])
  np.testing.assert_array_equal(scale[:, 0], np.array([1 / 448, 1.0, 1.0], np.float32))
  np.testing.assert_array_equal(_f32(qvalue[1]), 0.0)
  np.testing.assert_array_equal(_f32(qvalue[2]), 0.0)  # underflows to zero


def test_values_beyond_the_calibrated_range_saturate_instead_of_becoming_nan():
  x = np.array([[1.0, -100.0, 100.0, 5.0]], np.float32)
  qvalue, scale = fp8.quantize(x, E4M3, [], "fixed,10")
  np.testing.assert_array_equal(_f32(qvalue), [[44.0, -448.0, 448.0, 224.0]])
  np.testing.assert_allclose(fp8.dequantize(qvalue, scale), [[1.0, -10.0, 10.0, 5.0]], rtol=2 ** -4)
  qvalue, _ = fp8.quantize(x, E5M2, [], "absmax,0.01")
  assert _f32(qvalue).max() == 57344.0 and _f32(qvalue).min() == -57344.0
  assert np.isnan(np.array([500.0]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()  # unclipped cast


def test_inf_poisons_only_its_channel_and_nan_propagates():
  x = np.ones((3, 4), np.float32)
  x[0, 1], x[1, 2] = np.inf, np.nan
  deq = _f32(fp8.dequantize(*fp8.quantize(x, E4M3, channelwise_axes=[0])))
  assert np.isnan(deq[0]).all()  # scale inf: finite/inf -> 0, 0*inf -> nan
  assert np.isnan(deq[1]).all()  # absmax nan -> scale nan
  np.testing.assert_array_equal(deq[2], 1.0)


# Measured relative round-trip error of this input (both stacks): e4m3fn 0.026038, e5m2 0.051956 (tests/README.md).
@pytest.mark.parametrize("qtype,measured", [(E4M3, 0.026038), (E5M2, 0.051956)])
def test_round_trip_error_of_normal_data(qtype, measured):
  x = np.random.default_rng(2).normal(size=(64, 256)).astype(np.float32)
  qvalue, scale = fp8.quantize(x, qtype, [0])
  deq = np.asarray(fp8.dequantize(qvalue, scale), np.float32)
  rel = np.linalg.norm(deq - x) / np.linalg.norm(x)
  assert rel <= measured * 1.01
  assert rel >= measured / 2  # quantized at all: clearly away from the unquantized input
  scale = np.abs(x).max(axis=1, keepdims=True) / float(jnp.finfo(qtype).max)
  ulp_bound = 2.0 ** -(4 if qtype == E4M3 else 3)  # half a mantissa step, relative
  min_normal = float(jnp.finfo(qtype).smallest_normal)
  assert (np.abs(deq - x) <= np.maximum(ulp_bound * np.abs(x), min_normal * scale) * (1 + 1e-6)).all()


def test_scale_dtype_and_dequantize_dtype():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 4)), jnp.bfloat16)
  qvalue, scale = fp8.quantize(x, E4M3, [0], scale_dtype=jnp.float32)
  assert scale.dtype == jnp.float32 and fp8.dequantize(qvalue, scale).dtype == jnp.float32
  _, bf16_scale = fp8.quantize(x, E4M3, [0])
  np.testing.assert_array_equal(_f32(bf16_scale), _f32(scale))  # computed in bf16, then cast


@pytest.mark.parametrize("calibration", ["minmax", "fixed,-1,3", "rms", "absmax,x", "percentile,99", "fixed,3,-3"])
def test_rejects_calibrations_fp8_cannot_use(calibration):
  with pytest.raises(errors.QuantError, match="calibration method") as info:
    fp8.quantize(np.ones((2, 2), np.float32), E4M3, [0], calibration)
  assert "\n" not in str(info.value) and "absmax" in str(info.value)


def test_rejects_unknown_qtypes_and_integer_inputs():
  for qtype in (jnp.int4, "float16", "e4m4", jnp.float8_e4m3fnuz):
    with pytest.raises(errors.QuantError, match="float8_e4m3fn, float8_e5m2, int8"):
      fp8.quantize(np.ones((2, 2), np.float32), qtype)
  with pytest.raises(errors.QuantError, match="'int8'; accepted: float8_e4m3fn, float8_e5m2$"):
    fp8.block_quantize(np.ones((2, 2), np.float32), (1, 1), jnp.int8)  # DeepSeek's block layouts are FP8 only
  with pytest.raises(errors.QuantError, match="int32"):
    fp8.quantize(np.ones((2, 2), np.int32), E4M3)
  with pytest.raises(errors.QuantError, match="out of range"):
    fp8.quantize(np.ones((2, 2), np.float32), E4M3, [2])
  assert fp8.resolve_qtype("float8_e5m2") == np.dtype(E5M2) and fp8.resolve_qtype("e4m3") == np.dtype(E4M3)


@pytest.mark.parametrize("shape", [(2, 300, 200), (129, 257)])
def test_block_quantize_matches_a_numpy_reference_of_deepseeks_128x128_scheme(shape):
  """Against tests/deepseek_fp8_reference.py (amax / 448 per 128 x 128 block, float32 scale_inv, rounded-up block
  grid). Measured: fp8 values bit-identical; scales equal or one float32 ulp apart (XLA's division on CPU is not
  always correctly rounded; (2, 300, 200): 6 of 12 scales differ by 1 ulp)."""
  w = np.random.default_rng(4).normal(size=shape).astype(np.float32) * 3
  w[..., 128:256, 0:128] = 0.0  # an all-zero block gets scale 1
  qvalue, scale_inv = fp8.block_quantize(w, (128, 128))
  q_ref, s_ref = deepseek_fp8_reference.block_quantize(w)
  assert qvalue.shape == w.shape and qvalue.dtype == np.dtype(E4M3)
  assert scale_inv.shape == s_ref.shape == fp8.block_scale_shape(w.shape) and scale_inv.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(qvalue).view(np.uint8), q_ref.view(np.uint8))
  assert deepseek_fp8_reference.ulp_distance(scale_inv, s_ref).max() <= 1
  assert s_ref[..., 1, 0].min() == np.asarray(scale_inv)[..., 1, 0].min() == 1.0
  deq = np.asarray(fp8.block_dequantize(qvalue, scale_inv, (128, 128)))
  np.testing.assert_allclose(deq, deepseek_fp8_reference.block_dequantize(q_ref, s_ref), rtol=2.0**-22, atol=0)
  np.testing.assert_array_equal(deq[..., 128:256, 0:128], 0.0)


def test_block_quantize_accepts_bf16_and_other_blocks_and_rejects_bad_input():
  w = jnp.asarray(np.random.default_rng(5).normal(size=(64, 48)), jnp.bfloat16)
  qvalue, scale_inv = fp8.block_quantize(w, (32, 16), qtype="e5m2")
  assert qvalue.dtype == np.dtype(E5M2) and scale_inv.shape == (2, 3) and scale_inv.dtype == jnp.float32
  with pytest.raises(errors.QuantError, match="block shape"):
    fp8.block_quantize(w, (0, 128))
  with pytest.raises(errors.QuantError, match="rank >= 2"):
    fp8.block_quantize(np.ones(5, np.float32))
  with pytest.raises(errors.QuantError, match="expected \\(2, 3\\)"):
    fp8.block_dequantize(qvalue, np.ones((2, 2), np.float32), (32, 16))
