"""`quant.rounding`: quotients rounded as IEEE 754 rounds them, from a quotient a unit or two in the last place off
(what a TPU's float32 division gives), against numpy's exactly rounded float32 division and ml_dtypes' bf16."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from quant import rounding


def _operands(seed=0, n=200_000):
  rng = np.random.default_rng(seed)
  a = (rng.normal(size=n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
  b = (rng.uniform(0.5, 2.0, n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
  return a, b


def test_a_quotient_two_units_off_is_corrected_to_numpys_float32_division():
  a, b = _operands()
  want = a / b  # numpy: float32 division, exactly rounded
  for steps in (-2, -1, 1, 2):
    off = want.copy()
    for _ in range(abs(steps)):
      off = np.nextafter(off, np.float32(np.inf) if steps > 0 else np.float32(-np.inf))
    nearest = rounding._nearest  # pylint: disable=protected-access
    fixed = jax.jit(lambda x, y, q: nearest(x, y, nearest(x, y, q)))(a, b, off)
    np.testing.assert_array_equal(np.asarray(fixed), want)


def test_the_emulated_division_is_numpys_in_float32_and_bf16():
  """What a TPU runs (`emulated_divide`), here on a CPU against numpy's exactly rounded division."""
  a, b = _operands(1)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, y: rounding.emulated_divide(x, y, jnp.float32))(a, b)),
                                a / b)
  a16, b16 = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
  want = (a16.astype(np.float32) / b16.astype(np.float32)).astype(ml_dtypes.bfloat16)  # a CPU's bf16 division
  got = jax.jit(lambda x, y: rounding.emulated_divide(x, y, jnp.bfloat16))(a16, b16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


def test_the_emulated_quotients_are_xlas_cpu_division_bit_for_bit():
  """What a TPU runs for a quantizer's `x / scale` (`emulated_quotient`, `emulated_by_constant`) against what XLA
  compiles for it on a CPU (its simplifier multiplies by the reciprocal of a broadcast or constant divisor), in
  float32 and bf16, same-shape divisors included. (In a fused model XLA may divide instead: there the two can differ
  by a unit in the last place, which the FP8 rounding that follows almost never sees.)"""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(512, 64)).astype(np.float32) * 3
  cpu = jax.devices("cpu")[0]  # the reference is a CPU's, wherever the test runs; the emulation runs on the default
  for dtype in (jnp.float32, jnp.bfloat16):
    xd = jnp.asarray(x, dtype)
    for scale in (rng.uniform(1e-3, 0.1, (1, 64)), rng.uniform(1e-3, 0.1, (512, 1)), rng.uniform(1e-3, 0.1, (512, 64))):
      s = jnp.asarray(scale, dtype)
      want = jax.jit(lambda a, b: a / b)(jax.device_put(xd, cpu), jax.device_put(s, cpu))
      got = jax.jit(rounding.emulated_quotient)(xd, s)
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    want = jax.jit(lambda a: a / 448.0)(jax.device_put(xd, cpu))
    got = jax.jit(lambda a: rounding.emulated_by_constant(a, 448.0))(xd)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
