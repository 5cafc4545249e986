"""On a TPU chip (marked `tpu`: skipped elsewhere, `make test-tpu` runs them): our grouped-matmul kernel compiled by
Mosaic, FP8 products against numpy's FP8 arithmetic, matmul precision (the commands: tests/test_tpu_commands.py).

References are numpy (float64, ml_dtypes' FP8 rounding) and the same export made on the host's CPU; bounds are the
errors measured on a TPU v5e (docs/benchmarks.md, "On the chip").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from quant.gmm import kernel

import fp8_products

pytestmark = pytest.mark.tpu

E4M3 = jnp.float8_e4m3fn
GROUPS = np.array([700, 0, 301, 5, 0, 530, 100], np.int32)  # 1636 rows of 2048: empty groups, boundaries in tiles


def _rel(x, y) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def _segments():
  start = 0
  for g, size in enumerate(GROUPS):
    yield g, slice(start, start + int(size))
    start += int(size)


def _operands(dtype, m=2048, k=768, n=640):
  key = jax.random.key(1)
  k1, k2, k3 = jax.random.split(key, 3)
  if dtype == jnp.int8:
    make = lambda k, shape: jax.random.randint(k, shape, -127, 128, jnp.int32).astype(jnp.int8)
  else:
    make = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)
  return make(k1, (m, k)), make(k2, (len(GROUPS), k, n)), make(k3, (m, n))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, E4M3, jnp.int8], ids=["bf16", "fp8", "int8"])
def test_our_kernel_compiled_for_the_chip_equals_numpy(dtype):
  """gmm, gmm with the weight transposed and tgmm, with row and column scales, against float64 numpy on the same
  operands: exact products, float32 (int32 for int8) sums."""
  lhs, rhs, grad = _operands(dtype)
  groups = jnp.asarray(GROUPS)
  row = jnp.linspace(0.5, 2.0, lhs.shape[0], dtype=jnp.float32)[:, None]
  col = jnp.linspace(2.0, 0.5, rhs.shape[2], dtype=jnp.float32)[None, :]
  tiling = kernel.Tiling(512, 256, 256)
  out = kernel.gmm(lhs, rhs, groups, row, col, out_dtype=jnp.float32, tiling=tiling)
  dlhs = kernel.gmm(grad, rhs, groups, out_dtype=jnp.float32, tiling=tiling, transpose_rhs=True)
  drhs = kernel.tgmm(lhs, grad, groups, col, out_dtype=jnp.float32, tiling=tiling)
  l64, r64, g64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (lhs, rhs, grad))
  r64_row, c64 = np.asarray(row, np.float64), np.asarray(col, np.float64)
  worst = 0.0
  for g, rows in _segments():
    if rows.stop > rows.start:
      worst = max(worst, _rel(np.asarray(out)[rows], l64[rows] @ r64[g] * r64_row[rows] * c64),
                  _rel(np.asarray(dlhs)[rows], g64[rows] @ r64[g].T),
                  _rel(np.asarray(drhs)[g], l64[rows].T @ g64[rows] * c64))
    else:
      assert not np.any(np.asarray(drhs)[g])  # an empty group's weight gradient is zero
  assert worst <= 2e-6, worst


def test_fp8_products_on_the_chip_are_numpys_fp8_arithmetic():
  """MaxText's fp8_full rule on the chip: Qwix's QT dot_general and our grouped matmul, fed inputs made on the chip,
  equal numpy's FP8 arithmetic on those inputs and stand as far from the unquantized product as FP8 rounding does."""
  got = fp8_products.measure("pallas")
  assert got.dense_vs_fp8 <= 2e-7  # measured 1.04e-7
  assert got.dense_vs_plain >= 0.02  # measured 0.037: FP8 rounding kept
  assert got.gmm_vs_fp8 <= 9e-5  # measured 8.41e-5 on a TPU v5e: not isolated (docs/benchmarks.md, on a TPU chip)
  assert got.gmm_vs_plain >= 0.02


def test_fp8_codes_widen_exactly_in_the_kernel():
  """Every float8_e4m3fn and float8_e5m2 code but NaN, widened inside a Pallas kernel on the chip: its exact value."""
  for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn if dtype == E4M3 else ml_dtypes.float8_e5m2)
    codes = np.where(np.isfinite(codes.astype(np.float32)), codes, codes[0])
    block = jnp.asarray(np.tile(codes, 16 * 32).reshape(32, 128 * 32)[:, :128 * 4])

    def widen(x_ref, o_ref):
      o_ref[...] = kernel.widen(x_ref[...], jnp.bfloat16).astype(jnp.float32)

    from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
    got = pl.pallas_call(widen, out_shape=jax.ShapeDtypeStruct(block.shape, jnp.float32))(block)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(block).astype(np.float32))


def test_highest_precision_makes_float32_products_exact_on_the_chip():
  """The chip's float32 matmul at DEFAULT precision rounds its operands (one bf16 pass); at HIGHEST it is exact:
  what `matmul_precision=highest` asks of every float32 matmul of the model."""
  a = jax.random.normal(jax.random.key(2), (256, 512), jnp.float32)
  b = jax.random.normal(jax.random.key(3), (512, 256), jnp.float32)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  assert _rel(jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST), want) <= 1e-6
  assert _rel(jnp.dot(a, b, precision=jax.lax.Precision.DEFAULT), want) >= 1e-4
