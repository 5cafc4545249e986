"""FP8 grouped matmul: numerics against fake-quant and float references, Qwix parity, gradients, interception."""

import logging

from absl import logging as absl_logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix
import qwix.pallas as qpl

from quant import errors, fp8
from quant.gmm import fp8 as gmm_fp8

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_RULE = qwix.QtRule(module_path=".*", weight_qtype=E4M3, act_qtype=E4M3, bwd_qtype=E5M2,
                       op_names=("dot_general", "gmm", "ragged_dot"))
GROUPS = np.array([20, 0, 31, 7, 30], np.int32)  # 88 rows in groups, 8 rows past them, an empty group
M, K, N = 96, 24, 20


def _data(seed=0, m=M, groups=GROUPS):
  rng = np.random.default_rng(seed)
  lhs = rng.normal(size=(m, K)).astype(np.float32)
  rhs = rng.normal(size=(len(groups), K, N)).astype(np.float32)
  cot = rng.normal(size=(m, N)).astype(np.float32)
  return lhs, rhs, cot


def _segments(groups, m):
  start = 0
  for g, size in enumerate(groups):
    yield g, slice(start, min(start + int(size), m))
    start += int(size)


def _ref_gmm(lhs, rhs, groups):
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  for g, rows in _segments(groups, lhs.shape[0]):
    out[rows] = np.asarray(lhs, np.float64)[rows] @ np.asarray(rhs, np.float64)[g]
  return out


def _ref_outer(lhs, grad, groups, num_groups):
  out = np.zeros((num_groups, lhs.shape[1], grad.shape[1]))
  for g, rows in _segments(groups, lhs.shape[0]):
    out[g] = np.asarray(lhs, np.float64)[rows].T @ np.asarray(grad, np.float64)[rows]
  return out


def _fake_quant(x, qtype, axes, calibration="absmax"):
  """numpy quantize with the scales of fp8.compute_scale; returns (fp8 values as float64, float64 scale)."""
  scale = np.asarray(fp8.compute_scale(x, qtype, axes, calibration), np.float32)
  info = jnp.finfo(qtype)
  q = np.clip(np.asarray(x, np.float32) / scale, float(info.min), float(info.max))
  ml_type = ml_dtypes.float8_e4m3fn if np.dtype(qtype) == np.dtype(E4M3) else ml_dtypes.float8_e5m2
  return q.astype(ml_type).astype(np.float64), scale.astype(np.float64)


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _grads(rule, lhs, rhs, cot, groups=GROUPS, **kw):
  loss = lambda l, r: jnp.sum(cot * gmm_fp8.quantized_gmm(l, r, groups, rule, **kw))
  return [np.asarray(g, np.float64) for g in jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)]


def _float_grads(lhs, rhs, cot, groups=GROUPS):
  dlhs = np.zeros_like(lhs, np.float64)
  for g, rows in _segments(groups, lhs.shape[0]):
    dlhs[rows] = np.asarray(cot, np.float64)[rows] @ rhs[g].T.astype(np.float64)
  return dlhs, _ref_outer(lhs, cot, groups, len(groups))


@pytest.mark.parametrize("strategy", gmm_fp8.STRATEGIES)
def test_plain_path_equals_float_grouped_matmul_for_no_rule_and_a_rule_that_quantizes_nothing(strategy):
  lhs, rhs, cot = _data()
  expected = _ref_gmm(lhs, rhs, GROUPS)
  dlhs_ref, drhs_ref = _float_grads(lhs, rhs, cot)
  for rule in (None, qwix.QtRule(weight_qtype=None, act_qtype=None, bwd_qtype=None)):
    out = gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, rule, tile_rows=16, strategy=strategy)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    dlhs, drhs = _grads(rule, lhs, rhs, cot, tile_rows=16, strategy=strategy)
    np.testing.assert_allclose(dlhs, dlhs_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(drhs, drhs_ref, rtol=1e-5, atol=1e-5)


def test_act_only_rule_quantizes_the_activations_as_megablox_does():
  """MaxText's Megablox gmm quantizes each operand its rule names; an act-only rule used to run unquantized here."""
  lhs, rhs, cot = _data(7)
  rule = qwix.QtRule(weight_qtype=None, act_qtype=E4M3, bwd_qtype=None)
  q_lhs, s_lhs = _fake_quant(lhs, E4M3, [0])
  expected = _ref_gmm(q_lhs, rhs, GROUPS) * s_lhs
  out = gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, rule, tile_rows=16)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
  assert _rel(out, _ref_gmm(lhs, rhs, GROUPS)) > 0.01  # visibly quantized
  dlhs, drhs = _grads(rule, lhs, rhs, cot, tile_rows=16)
  dlhs_ref, _ = _float_grads(lhs, rhs, cot)
  np.testing.assert_allclose(dlhs, dlhs_ref, rtol=1e-5, atol=1e-5)  # straight-through, float weight
  drhs_ref = _ref_outer(q_lhs, np.where(np.arange(M)[:, None] < GROUPS.sum(), cot * s_lhs, 0), GROUPS, len(GROUPS))
  np.testing.assert_allclose(drhs, drhs_ref, rtol=1e-5, atol=1e-5 * np.abs(drhs_ref).max())  # the fp8 residual


def test_bwd_only_rule_quantizes_only_the_gradients_as_megablox_does():
  """A bwd-only rule: exact forward, e5m2 gradients (per row for dlhs, per column for drhs), as in Megablox."""
  lhs, rhs, cot = _data(8)
  rule = qwix.QtRule(weight_qtype=None, act_qtype=None, bwd_qtype=E5M2)
  out = gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, rule, tile_rows=16)
  np.testing.assert_allclose(out, _ref_gmm(lhs, rhs, GROUPS), rtol=1e-5, atol=1e-5)
  dlhs, drhs = _grads(rule, lhs, rhs, cot, tile_rows=16)
  cot_in = np.where(np.arange(M)[:, None] < GROUPS.sum(), cot, 0).astype(np.float32)
  q_row, s_row = _fake_quant(cot_in, E5M2, [0])
  q_col, s_col = _fake_quant(cot_in, E5M2, [1])
  dlhs_ref, _ = _float_grads(lhs, rhs, q_row * s_row)
  drhs_ref = _ref_outer(lhs, q_col, GROUPS, len(GROUPS)) * s_col[None]
  np.testing.assert_allclose(dlhs, dlhs_ref, rtol=1e-5, atol=1e-5 * np.abs(dlhs_ref).max())
  np.testing.assert_allclose(drhs, drhs_ref, rtol=1e-5, atol=1e-5 * np.abs(drhs_ref).max())
  assert _rel(dlhs, _float_grads(lhs, rhs, cot)[0]) > 0.02  # e5m2 visibly rounds


@pytest.mark.parametrize("strategy", gmm_fp8.STRATEGIES)
def test_quantized_forward_equals_manual_fake_quant_reference(strategy):
  lhs, rhs, _ = _data(1)
  q_lhs, s_lhs = _fake_quant(lhs, E4M3, [0])  # per row
  q_rhs, s_rhs = _fake_quant(rhs, E4M3, [2])  # per output column, shared by the experts
  assert s_lhs.shape == (M, 1) and s_rhs.shape == (1, 1, N)
  expected = _ref_gmm(q_lhs, q_rhs, GROUPS) * s_lhs * s_rhs[0]
  out = gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, FP8_RULE, tile_rows=16, strategy=strategy)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
  rel = _rel(out, _ref_gmm(lhs, rhs, GROUPS))
  assert 0.01 < rel < 0.05  # about 3 % for normal data
  np.testing.assert_array_equal(np.asarray(out)[88:], 0.0)


def test_weight_scale_is_one_per_output_column_shared_across_experts():
  lhs, rhs, _ = _data(2)
  rhs[3, :, 0] *= 1e6  # expert 3's column 0 sets the scale of column 0 for every expert
  out = np.asarray(gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, qwix.QtRule(weight_qtype=E4M3)))
  shared_q, shared_s = _fake_quant(rhs, E4M3, [2])
  np.testing.assert_allclose(out, _ref_gmm(lhs, shared_q * shared_s, GROUPS), rtol=1e-5, atol=1e-4)
  per_expert_q, per_expert_s = _fake_quant(rhs, E4M3, [0, 2])
  rows0 = slice(0, 20)  # expert 0: its column 0 underflows to zero under the shared scale
  err_shared = np.abs(out[rows0, 0] - _ref_gmm(lhs, rhs, GROUPS)[rows0, 0]).max()
  err_per_expert = np.abs(_ref_gmm(lhs, per_expert_q * per_expert_s, GROUPS)[rows0, 0]
                          - _ref_gmm(lhs, rhs, GROUPS)[rows0, 0]).max()
  assert err_shared > 10 * err_per_expert


def test_rule_options_per_tensor_scales_weight_only_and_calibration():
  lhs, rhs, _ = _data(3)
  per_tensor = qwix.QtRule(weight_qtype=E4M3, act_qtype=E4M3, disable_channelwise_axes=True)
  q_lhs, s_lhs = _fake_quant(lhs, E4M3, [])
  q_rhs, s_rhs = _fake_quant(rhs, E4M3, [])
  assert s_lhs.shape == (1, 1) and s_rhs.shape == (1, 1, 1)
  np.testing.assert_allclose(gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, per_tensor),
                             _ref_gmm(q_lhs, q_rhs, GROUPS) * s_lhs * s_rhs[0], rtol=1e-5, atol=1e-4)
  weight_only = qwix.QtRule(weight_qtype=E4M3, act_qtype=None)
  q_rhs, s_rhs = _fake_quant(rhs, E4M3, [2])
  np.testing.assert_allclose(gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, weight_only),
                             _ref_gmm(lhs, q_rhs * s_rhs, GROUPS), rtol=1e-5, atol=1e-4)
  clipped = qwix.QtRule(weight_qtype=E4M3, act_qtype=E4M3, weight_calibration_method="fixed,0.5",
                        act_calibration_method="absmax,0.5")
  q_lhs, s_lhs = _fake_quant(lhs, E4M3, [0], "absmax,0.5")
  q_rhs, s_rhs = _fake_quant(rhs, E4M3, [2], "fixed,0.5")
  assert np.abs(q_rhs).max() == 448.0 and np.abs(q_rhs * s_rhs).max() == pytest.approx(0.5)  # saturated
  np.testing.assert_allclose(gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, clipped),
                             _ref_gmm(q_lhs, q_rhs, GROUPS) * s_lhs * s_rhs[0], rtol=1e-5, atol=1e-4)


def test_bf16_inputs_give_bf16_output_or_preferred_type():
  lhs, rhs, _ = _data(4)
  lhs16, rhs16 = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
  out = gmm_fp8.quantized_gmm(lhs16, rhs16, GROUPS, FP8_RULE)
  assert out.dtype == jnp.bfloat16
  out32 = gmm_fp8.quantized_gmm(lhs16, rhs16, GROUPS, FP8_RULE, preferred_element_type=jnp.float32)
  assert out32.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float32), out32, rtol=2 ** -7, atol=1e-2)
  assert _rel(out32, _ref_gmm(np.asarray(lhs16, np.float32), np.asarray(rhs16, np.float32), GROUPS)) < 0.05


@pytest.mark.parametrize("strategy", gmm_fp8.STRATEGIES)
def test_backward_quantizes_the_gradient_to_e5m2_like_maxtext(strategy):
  lhs, rhs, cot = _data(5)
  dlhs, drhs = _grads(FP8_RULE, lhs, rhs, cot, tile_rows=16, strategy=strategy)
  q_lhs, s_lhs = _fake_quant(lhs, E4M3, [0])
  q_rhs, s_rhs = _fake_quant(rhs, E4M3, [2])
  cot_in = cot.copy()
  cot_in[88:] = 0.0  # rows past the groups have constant outputs
  # dlhs: (g * rhs_scale) quantized per row against the fp8 weights.
  q_d, s_d = _fake_quant(cot_in * s_rhs[0].astype(np.float32), E5M2, [0])
  dlhs_ref = np.zeros((M, K))
  for g, rows in _segments(GROUPS, M):
    dlhs_ref[rows] = q_d[rows] @ q_rhs[g].T * s_d[rows]
  np.testing.assert_allclose(dlhs, dlhs_ref, rtol=1e-5, atol=1e-5 * np.abs(dlhs_ref).max())
  # drhs: (g * lhs_scale) quantized per column against the fp8 activations, summed per group.
  q_e, s_e = _fake_quant(cot_in * s_lhs.astype(np.float32), E5M2, [1])
  drhs_ref = _ref_outer(q_lhs, q_e, GROUPS, len(GROUPS)) * s_e[None]
  np.testing.assert_allclose(drhs, drhs_ref, rtol=1e-5, atol=1e-5 * np.abs(drhs_ref).max())


def test_gradients_are_close_to_float_gradients_and_bwd_quantization_matters():
  lhs, rhs, cot = _data(6)
  float_grads = _grads(None, lhs, rhs, cot)
  fwd_only = _grads(qwix.QtRule(weight_qtype=E4M3, act_qtype=E4M3, bwd_qtype=None), lhs, rhs, cot)
  full = _grads(FP8_RULE, lhs, rhs, cot)
  for f, a, b in zip(float_grads, fwd_only, full):
    assert np.isfinite(b).all()
    assert 0.01 < _rel(a, f) < 0.05  # fp8 residuals only
    assert 0.03 < _rel(b, f) < 0.09  # plus e5m2 gradients
    assert _rel(b, a) > 0.02
  # straight-through estimator with unquantized gradients: d lhs = g @ deq(rhs)^T, d rhs = deq(lhs)^T @ g.
  q_lhs, s_lhs = _fake_quant(lhs, E4M3, [0])
  q_rhs, s_rhs = _fake_quant(rhs, E4M3, [2])
  np.testing.assert_allclose(fwd_only[1], _ref_outer(q_lhs * s_lhs, np.where(np.arange(M)[:, None] < 88, cot, 0),
                                                     GROUPS, len(GROUPS)), rtol=1e-5, atol=1e-4)
  expected_dlhs = np.zeros((M, K))
  for g, rows in _segments(GROUPS, M):
    expected_dlhs[rows] = cot[rows] @ (q_rhs[g] * s_rhs[0]).T
  np.testing.assert_allclose(fwd_only[0], expected_dlhs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("strategy", gmm_fp8.STRATEGIES)
def test_empty_groups_and_rows_past_the_groups_give_zeros_in_both_directions(strategy):
  lhs, rhs, cot = _data(7)
  lhs[90] = np.inf  # garbage past the groups must not leak into outputs or gradients
  cot[93] = np.nan
  groups = np.array([0, 30, 0, 0, 58], np.int32)
  out = np.asarray(gmm_fp8.quantized_gmm(lhs, rhs, groups, FP8_RULE, tile_rows=16, strategy=strategy))
  np.testing.assert_array_equal(out[88:], 0.0)
  assert np.isfinite(out).all()
  dlhs, drhs = _grads(FP8_RULE, lhs, rhs, cot, groups, tile_rows=16, strategy=strategy)
  np.testing.assert_array_equal(dlhs[88:], 0.0)
  np.testing.assert_array_equal(drhs[[0, 2, 3]], 0.0)
  assert np.isfinite(dlhs).all() and np.isfinite(drhs).all() and np.abs(drhs[[1, 4]]).min() >= 0
  all_empty = gmm_fp8.quantized_gmm(lhs[:88], rhs, np.zeros(5, np.int32), FP8_RULE)
  np.testing.assert_array_equal(all_empty, 0.0)


def test_strategies_tiles_and_jit_agree_on_random_group_layouts():
  rng = np.random.default_rng(8)
  lhs, rhs, cot = _data(8)

  def value_and_grads(strategy, tile):
    loss = lambda l, r, gs: jnp.sum(cot * gmm_fp8.quantized_gmm(l, r, gs, FP8_RULE, tile_rows=tile,
                                                                 strategy=strategy))
    return jax.jit(jax.value_and_grad(loss, (0, 1)))

  fns = [value_and_grads("loop", 8), value_and_grads("batched", 24)]
  for _ in range(4):  # group sizes are traced: one compilation per function
    groups = rng.multinomial(int(rng.integers(0, M + 1)), np.ones(5) / 5).astype(np.int32)
    (value, (dlhs, drhs)), *others = [fn(lhs, rhs, groups) for fn in fns]
    for other_value, (other_dlhs, other_drhs) in others:
      assert float(other_value) == pytest.approx(float(value), rel=1e-5, abs=1e-4)
      np.testing.assert_allclose(other_dlhs, dlhs, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(other_drhs, drhs, rtol=1e-5, atol=1e-5)


class _RaggedExperts(nnx.Module):
  """Calls jax.lax.ragged_dot, which a QtProvider turns into Qwix's ragged_dot_qt."""

  def __call__(self, x, w, groups):
    return jax.lax.ragged_dot(x, w, groups)


def test_matches_qwix_ragged_dot_qt_forward_and_gradients():
  groups = np.array([20, 0, 31, 7, 38], np.int32)  # every row in a group (Qwix calibrates padding rows too)
  lhs, rhs, cot = _data(9)
  qwix_model = qwix.quantize_model(_RaggedExperts(), qwix.QtProvider([FP8_RULE]), lhs, rhs, groups)
  loss = lambda fn: (lambda l, r: jnp.sum(cot * fn(l, r)))
  ours = lambda l, r: gmm_fp8.quantized_gmm(l, r, groups, FP8_RULE)
  theirs = lambda l, r: qwix_model(l, r, groups)
  np.testing.assert_allclose(ours(lhs, rhs), jax.jit(theirs)(lhs, rhs), rtol=1e-6, atol=1e-6)
  grads = [jax.jit(jax.grad(loss(fn), (0, 1)))(lhs, rhs) for fn in (ours, theirs)]
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


class _GmmExperts(nnx.Module):
  """Asks for the "gmm" rule like MaxText's MoE block, then runs a control dot_general."""

  def __init__(self, rhs, proj):
    self.w = nnx.Param(jnp.asarray(rhs))
    self.proj = nnx.Param(jnp.asarray(proj))

  def __call__(self, x, groups):
    rule = qpl.get_current_rule("gmm")
    y = gmm_fp8.quantized_gmm(x, self.w[...], groups, rule)
    return jax.lax.dot_general(y, self.proj[...], (((1,), (0,)), ((), ()))), rule


def test_internal_ops_are_invisible_to_qwix_interception():
  lhs, rhs, _ = _data(10)
  proj = np.random.default_rng(10).normal(size=(N, 4)).astype(np.float32)
  messages = []
  handler = logging.Handler()
  handler.emit = lambda record: messages.append(record.getMessage())
  absl_logger = logging.getLogger("absl")
  old_verbosity = absl_logging.get_verbosity()
  absl_logger.addHandler(handler)
  absl_logging.set_verbosity(absl_logging.DEBUG)
  try:
    model = qwix.quantize_model(_GmmExperts(rhs, proj), qwix.QtProvider([FP8_RULE]), lhs, GROUPS)
    out, rule = model(lhs, GROUPS)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(model(x, GROUPS)[0])))(lhs)
  finally:
    absl_logger.removeHandler(handler)
    absl_logging.set_verbosity(old_verbosity)
  assert isinstance(rule, qwix.QtRule) and (rule.weight_qtype, rule.bwd_qtype) == (E4M3, E5M2)
  assert [m for m in messages if "[QWIX]" in m] == ["[QWIX] module='' op=dot_general0 rule=0"]  # the control only
  # Outside any provider the same quantized gmm gives the same values: nothing inside was quantized twice.
  y = gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, FP8_RULE)
  assert np.abs(np.asarray(out)).max() > 0 and np.isfinite(np.asarray(grad)).all()
  q_y, s_y = _fake_quant(y, E4M3, [0])
  q_p, s_p = _fake_quant(proj, E4M3, [1])
  np.testing.assert_allclose(out, (q_y @ q_p) * s_y * s_p, rtol=1e-5, atol=1e-5)


def test_rejects_bad_rules_shapes_and_options():
  lhs, rhs, _ = _data(11)
  cases = [
      (qwix.QuantizationRule(weight_qtype=E4M3), "qwix.QtRule"),
      (qwix.QtRule(weight_qtype=jnp.int8), "float8_e4m3fn, float8_e5m2"),
      (qwix.QtRule(weight_qtype=E4M3, bwd_calibration_method="minmax"), "calibration method"),
  ]
  for rule, message in cases:
    with pytest.raises(errors.QuantError, match=message):
      gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, rule)
  with pytest.raises(errors.QuantError, match="do not agree"):
    gmm_fp8.quantized_gmm(lhs, rhs[:4], GROUPS, FP8_RULE)
  with pytest.raises(errors.QuantError, match="lhs \\[M,K\\]"):
    gmm_fp8.quantized_gmm(lhs[None], rhs, GROUPS, FP8_RULE)
  with pytest.raises(errors.QuantError, match="integer dtype"):
    gmm_fp8.quantized_gmm(lhs, rhs, GROUPS.astype(np.float32), FP8_RULE)
  with pytest.raises(errors.QuantError, match="loop, batched"):
    gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, FP8_RULE, strategy="pallas")
  with pytest.raises(errors.QuantError, match="tile_rows"):
    gmm_fp8.quantized_gmm(lhs, rhs, GROUPS, FP8_RULE, tile_rows=0)
  config = gmm_fp8.config_from_rule(FP8_RULE)
  assert (config.weight_qtype, config.act_qtype, config.bwd_qtype) == ("float8_e4m3fn", "float8_e4m3fn",
                                                                       "float8_e5m2")
  assert gmm_fp8.config_from_rule(None) is None and gmm_fp8.config_from_rule(qwix.QtRule()) is None
