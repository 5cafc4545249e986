"""DeepSeek's 1×128 activation quantization (`quant.act_tiles`) against numpy + ml_dtypes, in a Linear under the
provider, in the grouped matmul, and the rules that put it before exactly the Linears the deepseek-fp8 layout stores
in FP8.

The reference is written here from the definition DeepSeek's inference code (`act_quant`) gives: per token, per tile
of 128 along the contraction, `s = amax(|tile|) / 448` (float32), `q = e4m3(clip(x / s))`, dequantized `q * s`.
"""

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
import jax
import jax.numpy as jnp

from quant import act_tiles
from quant.gmm import fp8 as gmm_fp8

E4M3 = ml_dtypes.float8_e4m3fn


def reference(x, tile=128):
  """numpy: x (..., K) quantized per row in tiles of `tile` along K, dequantized (float32)."""
  x = np.asarray(x, np.float32)
  out = np.empty_like(x)
  for start in range(0, x.shape[-1], tile):
    part = x[..., start:start + tile]
    amax = np.abs(part).max(axis=-1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    q = np.clip(part / s, -448, 448).astype(E4M3)
    out[..., start:start + tile] = q.astype(np.float32) * s
  return out


# XLA's float32 division on CPU may round 1 ulp off numpy's (tests/deepseek_fp8_reference.py), so a tile's scale may
# be 1 ulp apart: the dequantized values then differ by that (measured 1.85e-7 relative at most), while a different
# fp8 code would differ by 1/16 or more.
SCALE_RTOL = 3e-7


@pytest.mark.parametrize("shape", [(3, 5, 256), (2, 7, 320), (4, 64)])
def test_fake_quantize_equals_deepseeks_act_quant(shape):
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * np.float32(3.0)
  x[0, ..., :128] = 0  # an all-zero tile stays zero
  got = np.asarray(act_tiles.fake_quantize(x, (-1,)))
  want = reference(x)
  assert got.shape == x.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=SCALE_RTOL, atol=0)
  assert np.all(got[0, ..., :128] == 0)
  assert not np.array_equal(got, x)  # it does quantize


def test_several_contracted_axes_are_tiled_as_one_flattened_axis():
  x = np.random.default_rng(1).standard_normal((2, 3, 4, 80)).astype(np.float32)  # heads 4 x head_dim 80 -> 320
  got = np.asarray(act_tiles.fake_quantize(x, (2, 3)))
  want = reference(x.reshape(2, 3, 320)).reshape(x.shape)
  np.testing.assert_allclose(got, want, rtol=SCALE_RTOL, atol=0)
  moved = np.asarray(act_tiles.fake_quantize(np.moveaxis(x, 1, 3), (1, 2)))  # contraction not trailing
  assert np.array_equal(np.moveaxis(moved, 3, 1), got)


def test_bfloat16_activations_come_back_in_bfloat16():
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 256)), jnp.bfloat16)
  got = act_tiles.fake_quantize(x, (-1,))
  assert got.dtype == jnp.bfloat16
  want = reference(np.asarray(x, np.float32))
  rel = np.abs(np.asarray(got, np.float32) - want) / np.abs(want)
  # bf16 inputs often fall exactly halfway between two e4m3 values, where a scale 1 ulp off (XLA's division) rounds
  # the other way: one e4m3 step (measured on 3 of 1,024 values); everything else within bf16's own rounding.
  assert np.mean(rel <= 2.0**-8) >= 0.99 and rel.max() <= 2.0**-3


class _Linear(nnx.Module):
  def __init__(self, w):
    self.kernel = nnx.Param(jnp.asarray(w))

  def __call__(self, x):
    return jax.lax.dot_general(x, self.kernel[...], (((1,), (0,)), ((), ())))


class _Two(nnx.Module):
  def __init__(self, w1, w2):
    self.first, self.second = _Linear(w1), _Linear(w2)

  def __call__(self, x):
    return self.second(self.first(x))


def test_the_provider_quantizes_the_activations_of_the_matched_linears_only():
  import qwix  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(3)
  w1, w2 = rng.standard_normal((256, 192)).astype(np.float32), rng.standard_normal((192, 64)).astype(np.float32)
  x = rng.standard_normal((5, 256)).astype(np.float32)
  rule = act_tiles.ActTileRule(module_path="first", op_names=("dot_general",), act_qtype=act_tiles.QTYPE)
  model = qwix.quantize_model(_Two(w1, w2), act_tiles.ActTileProvider([rule]), jnp.asarray(x))
  got = np.asarray(model(jnp.asarray(x)))
  want = (reference(x) @ w1) @ w2  # the second Linear's input is not quantized
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert not np.allclose(got, (x @ w1) @ w2, rtol=1e-3, atol=1e-3)


def test_the_grouped_matmul_quantizes_its_rows_in_tiles_under_an_act_tile_rule():
  rng = np.random.default_rng(4)
  lhs = rng.standard_normal((12, 320)).astype(np.float32)
  rhs = rng.standard_normal((3, 320, 16)).astype(np.float32)
  sizes = np.array([5, 0, 6], np.int32)  # the last row belongs to no group
  rule = act_tiles.ActTileRule(op_names=("gmm",), act_qtype=act_tiles.QTYPE)
  got = np.asarray(gmm_fp8.quantized_gmm(lhs, rhs, sizes, rule))
  q = reference(lhs)
  want = np.zeros((12, 16), np.float32)
  want[:5], want[5:11] = q[:5] @ rhs[0], q[5:11] @ rhs[2]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert gmm_fp8.config_from_rule(rule).act_tile == 128 and gmm_fp8.config_from_rule(rule).weight_qtype is None


def test_the_layout_rules_reach_exactly_the_linears_stored_in_fp8():
  """Traced with Qwix over the whole model (MTP included): an op matches a rule exactly when its weight is one the
  deepseek-fp8 layout writes as float8_e4m3fn (`hf_names`); the router, eh_proj, head and norms are left alone."""
  from inspect_tool.hf import names as hf_names  # pylint: disable=import-outside-toplevel
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.coverage import trace  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import layout_numerics  # pylint: disable=import-outside-toplevel

  for keys in (["model_name=deepseek3-tiny", "mtp_num_layers=1"],
               ["model_name=deepseek3-tiny", "mtp_num_layers=1", "scan_layers=false"]):
    cfg = config.resolve_config(keys)
    ops = trace.trace(cfg, rules=layout_numerics.rules(cfg)).ops
    matched = {op.weight for op in ops if op.rule is not None}
    fp8 = {"/".join(key[2:]) for key, entry in hf_names.leaf_plan(cfg).items()
           if entry.rule.kind in (hf_names.FP8, hf_names.EXPERTS_FP8)}
    assert matched == fp8 and len(fp8) > 20, keys
    assert {op.op_name for op in ops if op.rule is not None} == {"dot_general", "gmm"}
