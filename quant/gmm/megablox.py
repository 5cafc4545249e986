"""JAX's Pallas Megablox grouped matmul (`gmm_backend=megablox`, kept to compare with): compiled by Mosaic for a TPU
target, Pallas interpret mode elsewhere (the target is `quant.gmm.target.platform()`: a TPU topology compiled from
any host counts as TPU). `gmm_backend=pallas` is our own kernel (`quant.gmm.kernel`).

Megablox multiplies bfloat16 or float32 tiles with float32 accumulation. FP8 operands enter as bfloat16, which
holds every float8_e4m3fn and float8_e5m2 value exactly, so each tile product is the exact product of the fp8
values, as on an FP8 matrix unit; the caller applies the scales to the float32 result. Shapes: the row count is
padded to a multiple of the row tile (Megablox requires it); K and N may be ragged against their tiles.
"""

import jax
import jax.numpy as jnp

from quant import compat
from quant.gmm import kernel
from quant.gmm import target

MAXTEXT_TILING = kernel.Tiling(512, 1024, 1024)  # MaxText 0.2.5's default tile keys


def interpret() -> bool:
  """Interpret mode unless the program is compiled for TPU (where Mosaic compiles the kernel)."""
  return target.platform() != "tpu"


def _operand(x, other):
  """bfloat16 when both operands are bfloat16 or fp8 (fp8 is exact in bfloat16), else float32."""
  narrow = (jnp.dtype(jnp.bfloat16),)
  small = lambda d: jnp.dtype(d) in narrow or jnp.dtype(d).itemsize == 1
  return x.astype(jnp.bfloat16 if small(x.dtype) and small(other.dtype) else jnp.float32)


def _precision(a, b):
  """Its tile products at HIGHEST for float32 operands (every bit), the default for bf16 ones (Mosaic refuses HIGHEST
  there), whatever JAX_DEFAULT_MATMUL_PRECISION says."""
  wide = jnp.dtype(_operand(a, b).dtype) == jnp.float32
  return jax.default_matmul_precision("highest" if wide else "default")


def _pad_rows(x, tm: int):
  pad = -x.shape[0] % tm
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _fit(tiling: kernel.Tiling | None, m: int, k: int, n: int) -> tuple[int, int, int]:
  fitted = (tiling or MAXTEXT_TILING).fit(m, k, n, 16)
  return fitted.tm, fitted.tk, fitted.tn


def matmul(lhs, rhs, group_sizes, *, tiling: kernel.Tiling | None, transpose_rhs: bool = False,
           out_dtype=jnp.float32):
  """`lhs[r] @ rhs[g(r)]` (`.T` with transpose_rhs), accumulated in float32 and stored as `out_dtype` by the kernel
  (as MaxText's Megablox call stores bf16); rows past the groups are undefined (mask them)."""
  kernels = compat.megablox_kernels()
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  fitted = _fit(tiling, m, k, n)
  with _precision(lhs, rhs):
    out = kernels.gmm(_pad_rows(_operand(lhs, rhs), fitted[0]), _operand(rhs, lhs), group_sizes, out_dtype, fitted,
                      transpose_rhs=transpose_rhs, interpret=interpret())
  return out[:m]


def outer(lhs, grad, group_sizes, *, tiling: kernel.Tiling | None, out_dtype=jnp.float32):
  """`sum over rows r of group g: lhs[r]^T grad[r]` -> [G, K, N], accumulated in float32, stored as `out_dtype`;
  empty groups give 0."""
  kernels = compat.megablox_kernels()
  m, k = lhs.shape
  fitted = _fit(tiling, m, k, grad.shape[1])
  lhs_t = _pad_rows(_operand(lhs, grad), fitted[0]).swapaxes(0, 1)
  with _precision(lhs, grad):
    return kernels.tgmm(lhs_t, _pad_rows(_operand(grad, lhs), fitted[0]), group_sizes, out_dtype, fitted,
                        num_actual_groups=group_sizes.shape[0], interpret=interpret())
