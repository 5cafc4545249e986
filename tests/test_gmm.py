"""quant.gmm.op: the plain grouped matmul, its rule lookup and its hand-off to the FP8 grouped matmul."""

import logging
import subprocess
import sys

from absl import logging as absl_logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from quant.gmm import backends as gmm_backends
from quant.gmm import op as gmm_lib
from conftest import REPO


def _reference(lhs, rhs, group_sizes):
  """Float64 numpy grouped matmul; rows past the last group are zero."""
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    out[start:start + size] = lhs[start:start + size] @ rhs[g]
    start += size
  return out


def _inputs(rows=23, k=8, n=5, sizes=(4, 0, 7, 1, 6), seed=0):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((rows, k)).astype(np.float32)
  rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
  return lhs, rhs, np.asarray(sizes, np.int32)


def test_plain_gmm_matches_float_reference_with_empty_groups_and_padding_rows():
  lhs, rhs, sizes = _inputs()  # 18 rows in groups, 5 padding rows
  out = gmm_lib.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes))
  assert out.shape == (23, 5) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), _reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[18:] == 0)


def test_plain_gmm_in_bfloat16_accumulates_in_float32_and_returns_requested_dtype():
  lhs, rhs, sizes = _inputs(rows=18, k=64, n=16, sizes=(6, 12))
  lhs_b, rhs_b = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
  out = gmm_lib.gmm(lhs_b, rhs_b, jnp.asarray(sizes), preferred_element_type=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  expected = _reference(np.asarray(lhs_b.astype(jnp.float32)), np.asarray(rhs_b.astype(jnp.float32)), sizes)
  np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, rtol=1e-2, atol=1e-2)


def test_plain_gmm_works_under_jit():
  lhs, rhs, sizes = _inputs()
  out = jax.jit(gmm_lib.gmm)(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes))
  np.testing.assert_allclose(np.asarray(out), _reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


def test_gmm_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match="gmm expects"):
    gmm_lib.gmm(jnp.ones((4, 3)), jnp.ones((2, 5, 2)), jnp.asarray([2, 2]))


def test_rule_that_quantizes_nothing_runs_the_plain_path():
  lhs, rhs, sizes = _inputs()
  rule = qwix.QtRule(module_path=".*", weight_qtype=None, act_qtype=None, bwd_qtype=None)
  out = gmm_lib.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), rule=rule)
  np.testing.assert_allclose(np.asarray(out), _reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


def test_rule_is_handed_to_gmm_fp8_with_the_resolved_backend(monkeypatch):
  calls = []
  real = gmm_lib.gmm_fp8.quantized_gmm

  def spy(*args, **kwargs):
    calls.append((args, kwargs))
    return real(*args, **kwargs)

  monkeypatch.setattr(gmm_lib.gmm_fp8, "quantized_gmm", spy)
  lhs, rhs, sizes = _inputs()
  rule = qwix.QtRule(module_path=".*", weight_qtype=None, act_qtype=jnp.float8_e4m3fn)  # act-only quantizes too
  out = gmm_lib.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), preferred_element_type=jnp.bfloat16,
                    rule=rule)
  assert out.shape == (23, 5) and out.dtype == jnp.bfloat16
  gmm_lib.gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), backend="xla")
  (quantized, quantized_kw), (plain, plain_kw) = calls
  assert quantized[3] is rule and quantized[4] == jnp.bfloat16 and quantized[0].shape == (23, 8)
  assert quantized_kw == {"backend": gmm_backends.resolve("auto"), "tiles": None}  # reference on a CPU, pallas on TPU
  assert plain[3] is None and plain_kw == {"backend": "xla", "tiles": None}


def test_current_rule_is_none_outside_qwix():
  assert gmm_lib.current_rule() is None


class _Experts(nnx.Module):
  """A module whose own method calls gmm, as MaxText's MoE block does."""

  def __init__(self):
    self.w = nnx.Param(jnp.ones((2, 4, 3), jnp.float32))

  def __call__(self, x):
    return gmm_lib.gmm(x, self.w[...], jnp.asarray([3, 2], jnp.int32))


def test_under_qwix_gmm_asks_for_the_modules_rule_and_logs_no_op(monkeypatch):
  lines, lookups = [], []

  class Handler(logging.Handler):
    def emit(self, record):
      lines.append(record.getMessage())

  class Provider(qwix.QtProvider):
    def _get_current_rule_and_op_id(self, op_name, *, only_rule=False, repeated_call=False):
      found = super()._get_current_rule_and_op_id(op_name, only_rule=only_rule, repeated_call=repeated_call)
      if only_rule:
        lookups.append((op_name, found[0]))
      return found

  handler = Handler()
  absl_logging.set_verbosity(absl_logging.DEBUG)
  logging.getLogger("absl").addHandler(handler)
  try:
    rule = qwix.QtRule(module_path=".*", op_names=("dot_general", "einsum", "ragged_dot", "gmm"))
    model = qwix.quantize_model(_Experts(), Provider([rule]), jnp.ones((5, 4), jnp.float32))
    out = model(jnp.ones((5, 4), jnp.float32))
  finally:
    logging.getLogger("absl").removeHandler(handler)
    absl_logging.set_verbosity(absl_logging.WARNING)
  np.testing.assert_allclose(np.asarray(out), np.full((5, 3), 4.0))
  assert lookups and all(op == "gmm" and found is not None for op, found in lookups)
  assert not [line for line in lines if line.startswith("[QWIX]")]


def test_importing_quant_does_not_import_jax():
  code = "import sys, quant; assert 'jax' not in sys.modules, 'jax imported'"
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
