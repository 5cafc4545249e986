"""MaxText's NVIDIA (fp8_gpu) and NANOO (fp8_nanoo) FP8 providers: Flax's FP8 ops on their initial state."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import qwix

from inspect_tool.run import batch
from inspect_tool.configuration import config
from inspect_tool.run import runner as running
from quant import fp8_providers
from quant.gmm import fp8 as gmm_fp8

DIMS = (((1,), (0,)), ((), ()))


def _operands(seed=0):
  rng = np.random.default_rng(seed)
  lhs = (rng.normal(size=(6, 16)) * 30).astype(np.float32)  # some values past e4m3fnuz's 240 saturate
  lhs[0, 0] = 1000.0
  return jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rng.normal(size=(16, 5)) * 0.05, jnp.bfloat16)


def _flax(module, *args):
  """A fresh Flax Linen FP8 op applied once: what MaxText's provider runs on a newly built model."""
  variables = module.init(jax.random.key(0), *args)
  return module.apply(variables, *args)


def test_nvidia_dot_general_and_einsum_are_flax_fp8_ops_on_their_initial_state():
  lhs, rhs = _operands()
  np.testing.assert_array_equal(fp8_providers.nvidia_dot_general(lhs, rhs, DIMS),
                                _flax(nn.Fp8DirectDotGeneralOp(), lhs, rhs, DIMS))
  np.testing.assert_array_equal(fp8_providers.nvidia_einsum("md,dn->mn", lhs, rhs),
                                _flax(nn.Fp8Einsum(), "md,dn->mn", lhs, rhs))


def test_nanoo_dot_general_is_flaxs_nanoo_op_on_its_initial_state():
  lhs, rhs = _operands(1)
  np.testing.assert_array_equal(fp8_providers.nanoo_dot_general(lhs, rhs, DIMS),
                                _flax(nn.NANOOFp8DotGeneralOp(), lhs, rhs, DIMS))


def test_initial_state_means_unscaled_saturating_casts():
  """numpy: scale 1 casts each operand to fp8 as it is (±448 for e4m3fn, ±240 for e4m3fnuz)."""
  lhs, rhs = _operands(2)
  l32, r32 = np.asarray(lhs, np.float32), np.asarray(rhs, np.float32)
  for fn, fp8, top in ((fp8_providers.nvidia_dot_general, ml_dtypes.float8_e4m3fn, 448.0),
                       (fp8_providers.nanoo_dot_general, ml_dtypes.float8_e4m3fnuz, 240.0)):
    cast = lambda x: np.clip(x, -top, top).astype(fp8).astype(np.float64)
    want = cast(l32) @ cast(r32)
    got = np.asarray(fn(lhs, rhs, DIMS), np.float64)
    assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()  # bf16 output rounding
    assert np.abs(got - l32 @ r32).max() > 0.02 * np.abs(want).max()  # visibly quantized (saturation, rounding)


def test_modes_get_maxtexts_providers_and_the_experts_stay_unquantized_under_the_vendor_ones(monkeypatch):
  rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn, op_names=("dot_general",))]
  assert type(fp8_providers.provider("fp8", rules)) is qwix.QtProvider
  assert type(fp8_providers.provider("fp8_gpu", rules)) is fp8_providers.NvidiaFp8Provider
  assert type(fp8_providers.provider("fp8_nanoo", rules)) is fp8_providers.NanooFp8Provider
  seen = []
  real = gmm_fp8.quantized_gmm
  monkeypatch.setattr(gmm_fp8, "quantized_gmm", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
  keys = ["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=2",
          "first_num_dense_layers=1", "vocab_size=256"]
  data = batch.make_batch(batch.fixed_tokens(1, 8, 256))
  model = running.load_model(config.resolve_config(keys))
  plain = np.asarray(running.forward(model, data).logits, np.float64)
  for mode in ("fp8_gpu", "fp8_nanoo"):
    cfg = config.resolve_config(keys + [f"quantization={mode}"])
    logits = np.asarray(running.forward(running.quantize_for_training(model, cfg), data).logits, np.float64)
    assert 0.005 < np.linalg.norm(logits - plain) / np.linalg.norm(plain) < 0.5  # dense ops quantized
  assert seen and all(rule is None for rule in seen)  # gmm got no rule: experts in bf16
