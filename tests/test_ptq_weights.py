"""quant.ptq_weights: granularity from ops, bit-exact quantization, key layout and write errors; and the
pre-quantized grouped matmul (quant.gmm.op / quant.gmm.fp8) an export's experts run in."""


from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from qwix._src.core import qarray
from qwix._src.providers import ptq

from quant import coverage
from quant import dequant_error
from quant import errors
from quant import ptq_weights as qexport
from quant.gmm import op as gmm_lib
from quant.gmm import fp8 as gmm_fp8

E4M3 = "float8_e4m3fn"
RULE = qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn)


def _rng(seed=0):
  return np.random.default_rng(seed)


# Granularity ---------------------------------------------------------------------------------------------------


def test_dense_ops_keep_a_scale_per_non_contracted_axis():
  assert qexport.op_channel_axes("dot_general", 3, (0,), RULE) == (1, 2)  # wq_b (R, H, D)
  assert qexport.op_channel_axes("dot_general", 3, (0, 1), RULE) == (2,)  # out (H, Dv, E)
  assert qexport.op_channel_axes("einsum", 2, (-2,), RULE) == (1,)


def test_grouped_ops_keep_one_scale_per_output_column_shared_by_experts():
  assert qexport.op_channel_axes("gmm", 3, (1,), RULE) == (2,)
  assert qexport.op_channel_axes("ragged_dot", 3, (1,), RULE) == (2,)
  with pytest.raises(errors.QuantError, match="rank 2"):
    qexport.op_channel_axes("gmm", 2, (1,), RULE)


def test_disable_channelwise_axes_gives_one_scale_and_unsupported_rules_are_refused():
  per_tensor = qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn, disable_channelwise_axes=True)
  assert qexport.op_channel_axes("dot_general", 2, (0,), per_tensor) == ()
  assert qexport.op_channel_axes("gmm", 3, (1,), per_tensor) == ()
  with pytest.raises(errors.QuantError, match="tile_size"):
    qexport.op_channel_axes("dot_general", 2, (0,), qwix.QtRule(module_path=".*", weight_qtype=jnp.int8,
                                                                tile_size=128))
  with pytest.raises(errors.QuantError, match="conv_general_dilated"):
    qexport.op_channel_axes("conv_general_dilated", 4, (2,), RULE)


def test_a_scanned_stacks_layer_axis_keeps_its_own_scales():
  stored, operand = (16, 3, 64, 32), (16, 64, 32)  # experts (X, L, E, F) seen per layer as (X, E, F)
  extra = qexport.extra_axes(operand, stored, preferred=1)
  assert extra == (1,)
  axes = qexport.stored_channel_axes((2,), operand, stored, extra)
  assert axes == (1, 3)
  wq = qexport.WeightQuant(key=("params", "params", "w"), shape=stored, channel_axes=axes, qtype=E4M3)
  assert wq.scale_shape == (1, 3, 1, 32)
  assert qexport.extra_axes((4, 4), (4, 4, 4), preferred=1) == (1,)  # ambiguous sizes: the preferred axis
  assert qexport.extra_axes((8, 8), (8, 8)) == ()
  with pytest.raises(errors.QuantError, match="does not fit"):
    qexport.extra_axes((8, 8), (8, 3, 9))


def test_quantized_keys_follow_qwix_ptq_layout():
  key = ("params", "params", "decoder", "logits_dense", "kernel")
  qkey, skey = qexport.quantized_keys(key)
  assert qkey == key + ("array", "qvalue") and skey == key + ("array", "scale")


# Numerics ------------------------------------------------------------------------------------------------------


def test_quantize_weight_is_bit_identical_to_qwix_on_the_bf16_cast_weight():
  w = jnp.asarray(_rng().standard_normal((32, 3, 4, 24)).astype(np.float32))
  wq = qexport.WeightQuant(key=("w",), shape=w.shape, channel_axes=(1, 2, 3), qtype=E4M3)
  qvalue, scale = qexport.quantize_weight(w, wq)
  how = qarray.HowToQuantize(qtype=jnp.float8_e4m3fn, channelwise_axes=[1, 2, 3], tiled_axes={},
                             calibration_method="absmax")
  expected = qarray.quantize(w.astype(jnp.bfloat16), how)
  assert qvalue.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.bfloat16 and scale.shape == (1, 3, 4, 24)
  np.testing.assert_array_equal(np.asarray(qvalue).view(np.uint8), np.asarray(expected.qvalue).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(expected.scale))
  dequantized = np.asarray(qvalue).astype(np.float32) * np.asarray(scale).astype(np.float32)  # numpy reference
  err = np.abs(dequantized - np.asarray(w)).max()
  assert 0 < err < 0.1 * np.abs(np.asarray(w)).max()


def _rounding_edges() -> np.ndarray:
  """float32 values where a cast to bfloat16 rounds against the value: ties to even both ways, carries into the
  exponent, values that round up to bfloat16's infinity, subnormals, -0, and ordinary ones (8 channels of 64)."""
  rng = _rng(5)
  bits = rng.integers(0x3C00_0000, 0x4300_0000, 64 * 8, dtype=np.uint32)
  bits[:64] = (bits[:64] & 0xFFFF_0000) | 0x8000  # exact ties
  bits[64:128] = (bits[64:128] | 0x007F_0000) | 0x8001  # a carry into the exponent
  bits[128:192] = 0x7F7F_8000 + rng.integers(0, 0x8000, 64, dtype=np.uint32)  # at bfloat16's largest: inf or not
  bits[192:224] = rng.integers(1, 0x0080_0000, 32, dtype=np.uint32)  # subnormal float32 (beside normal ones: XLA's
  # CPU flushes subnormals, so a channel of nothing else has error figures 0 where numpy's are the values)
  bits[256] = 0x8000_0000  # -0
  x = bits.view(np.float32).copy()
  x[1::2] *= -1
  return x.reshape(8, 64)


@pytest.mark.parametrize("two_pass", [False, True])
def test_the_measured_quantizers_bytes_are_qwixs_on_the_bf16_cast_weight(two_pass):
  """The export's quantizers take the absmax on the float32 source and cast it (a float cast rounds monotonically);
  Qwix takes it on the cast weight: bit for bit the same, at every rounding edge. Their figures are numpy's."""
  x = jnp.asarray(_rounding_edges())
  wq = qexport.WeightQuant(key=("w",), shape=x.shape, channel_axes=(0,), qtype=E4M3)
  compiled = qexport.compiled_quantizers(x.shape, x.dtype, wq, two_pass=two_pass, measured=True)
  bits, scale, (largest, total) = compiled[-1](x, compiled[0](x)) if two_pass else compiled[0](x)
  how = qarray.HowToQuantize(qtype=jnp.float8_e4m3fn, channelwise_axes=[0], tiled_axes={},
                             calibration_method="absmax")
  expected = qarray.quantize(x.astype(jnp.bfloat16), how)
  assert np.asarray(bits).dtype == np.uint8
  qvalue = qexport.as_qtype(bits, E4M3, x.shape)
  assert qvalue.dtype == jnp.float8_e4m3fn
  want = np.asarray(expected.qvalue)
  nan = np.isnan(want.astype(np.float32))  # inf / inf in a channel whose absmax is inf: NaN, its sign XLA's choice
  assert nan.any() and np.isnan(qvalue.astype(np.float32)[nan]).all()
  np.testing.assert_array_equal(qvalue.view(np.uint8)[~nan], want.view(np.uint8)[~nan])
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(expected.scale))
  dequantized = qvalue.astype(np.float32) * np.asarray(scale).astype(np.float32)
  error = np.abs(dequantized - np.asarray(x))
  np.testing.assert_array_equal(np.asarray(largest).reshape(-1), error.max(axis=1))  # NaN where numpy's is
  np.testing.assert_allclose(np.asarray(total, np.float64).reshape(-1), error.astype(np.float64).sum(axis=1),
                             rtol=2e-6)


def test_the_measured_quantizers_temporaries_do_not_grow_with_the_slice():
  """On the CPU, the measured quantizer holds what a run of its loop needs (`dequant_error.CHUNK_BYTES` of float32
  at a time), not a bfloat16 or float16 copy of the slice: fresh pages at every call, a third of the export's
  quantizing time when it did (measured: 337 MiB of temporaries for a 640 MiB slice)."""
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  temps = []
  for experts in (16, 64):  # 64 and 256 MiB of float32, with an axis of size 1 as the export's expert slices have
    wq = qexport.WeightQuant(key=("w",), shape=(experts, 1, 1024, 1024), channel_axes=(0, 3), qtype=E4M3)
    compiled = qexport.compiled_quantizers(wq.shape, np.float32, wq, two_pass=False, sharding=cpu, measured=True)
    temps.append(compiled[0].memory_analysis().temp_size_in_bytes)
  assert max(temps) - min(temps) < 1 << 20 and max(temps) <= 2 * dequant_error.CHUNK_BYTES, temps


def test_quantize_weight_refuses_a_weight_of_another_shape():
  wq = qexport.WeightQuant(key=("params", "w"), shape=(4, 4), channel_axes=(1,), qtype=E4M3)
  with pytest.raises(errors.QuantError, match="params/w"):
    qexport.quantize_weight(jnp.ones((4, 5)), wq)


# Write errors -----------------------------------------------------------------------------------------------


def test_write_errors_name_the_reason_from_messages_too():
  assert qexport.write_error("/x", RuntimeError("PERMISSION_DENIED: Permission denied [/x/d]")).args[0] == (
      "cannot write '/x': permission denied")
  assert "boom" in str(qexport.write_error("/x", RuntimeError("boom\nmore")))


# Pre-quantized grouped matmul ----------------------------------------------------------------------------------


def _gmm_inputs(seed=0):
  rng = _rng(seed)
  lhs = jnp.asarray(rng.standard_normal((40, 16)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((4, 16, 12)), jnp.bfloat16)
  sizes = jnp.asarray([10, 0, 17, 9], jnp.int32)  # 4 padding rows
  return lhs, rhs, sizes


def _stored(rhs, rule=RULE):
  axes = () if rule.disable_channelwise_axes else (2,)
  wq = qexport.WeightQuant(key=("w",), shape=rhs.shape, channel_axes=axes, qtype=E4M3)
  return qexport.quantize_weight(rhs, wq)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_prequantized_gmm_equals_quantizing_on_the_fly(per_tensor):
  rule = qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn,
                     disable_channelwise_axes=per_tensor)
  lhs, rhs, sizes = _gmm_inputs()
  qvalue, scale = _stored(rhs, rule)
  expected = gmm_fp8.quantized_gmm(lhs, rhs, sizes, rule, jnp.bfloat16)
  got = gmm_fp8.prequantized_gmm(lhs, qvalue, scale, sizes, rule, jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
  assert np.all(np.asarray(got[36:], np.float32) == 0)


def test_prequantized_gmm_refuses_a_mis_shaped_scale_or_no_rule():
  lhs, rhs, sizes = _gmm_inputs()
  qvalue, _ = _stored(rhs)
  with pytest.raises(errors.QuantError, match="scale"):
    gmm_fp8.prequantized_gmm(lhs, qvalue, jnp.ones((1, 1, 5)), sizes, RULE)
  with pytest.raises(errors.QuantError, match="weight_qtype"):
    gmm_fp8.prequantized_gmm(lhs, qvalue, jnp.ones((1, 1, 12)), sizes, None)


def test_gmm_takes_a_qarray_or_ptq_withaux_weight():
  lhs, rhs, sizes = _gmm_inputs(1)
  qvalue, scale = _stored(rhs)
  array = qarray.QArray(qvalue, scale, None, jnp.float8_e4m3fn)
  expected = gmm_fp8.quantized_gmm(lhs, rhs, sizes, RULE, jnp.bfloat16)
  how = qarray.HowToQuantize(qtype=jnp.float8_e4m3fn, channelwise_axes=[2], tiled_axes={}, calibration_method="absmax")
  for weight in (array, ptq.WithAux(array, how)):
    assert gmm_lib.prequantized(weight) is not None
    got = gmm_lib.gmm(lhs, weight, sizes, preferred_element_type=jnp.bfloat16, rule=RULE)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
  assert gmm_lib.prequantized(rhs) is None
  plain = gmm_lib.gmm(lhs, array, sizes, preferred_element_type=jnp.float32)  # no rule: dequantized weight
  reference = gmm_lib.gmm(lhs, (qvalue.astype(jnp.float32) * scale.astype(jnp.float32)).astype(jnp.bfloat16), sizes,
                          preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(reference))


def test_prequantized_ragged_dot_equals_qwix_quantized_ragged_dot():
  from qwix._src.core import ragged_dot_qt  # pylint: disable=import-outside-toplevel

  lhs, rhs, sizes = _gmm_inputs(2)
  config = ragged_dot_qt.RaggedDotQtConfig(lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn)
  expected = ragged_dot_qt.ragged_dot_qt(lhs, rhs, sizes, config, None, jnp.bfloat16)
  qvalue, scale = _stored(rhs)
  weight = qarray.QArray(qvalue, scale, None, jnp.float8_e4m3fn)
  got = gmm_lib.prequantized_ragged_dot(lhs, weight, sizes, preferred_element_type=jnp.bfloat16, rule=RULE)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


# Coverage records the weight operand ---------------------------------------------------------------------------


class _Cast(nnx.Module):
  """A layer that casts its float32 kernel to bf16 before dot_general, contracting axis 0."""

  def __init__(self):
    self.kernel = nnx.Param(jnp.ones((6, 2, 5), jnp.float32))

  def __call__(self, x):
    kernel = self.kernel[...].astype(jnp.bfloat16)
    return jax.lax.dot_general(x.astype(jnp.bfloat16), kernel, (((1,), (0,)), ((), ())))


def test_coverage_records_the_operand_shape_dtype_and_contracted_axes():
  trace = coverage.trace_model(_Cast(), [RULE], jnp.ones((3, 6)))
  (op,) = [o for o in trace.ops if o.op_name == "dot_general"]
  assert op.weight == "kernel" and op.operand_shape == (6, 2, 5) and op.operand_dtype == "bfloat16"
  assert op.contracting == (0,)
