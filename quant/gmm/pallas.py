"""Our Pallas grouped matmul (`gmm_backend=pallas`, `auto` on TPU): `quant.gmm.kernel` compiled by Mosaic for a TPU
target, Pallas interpret mode elsewhere (the target is `quant.gmm.target.platform()`: a TPU topology compiled from
any host counts as TPU).

Operands enter in their own dtype (bf16, fp8, int8 or float32); the scales of a quantized product are applied by the
kernel to its float32 accumulator. The row count is padded to a multiple of the row tile, which is capped to the
problem (`kernel.Tiling.fit`); K and N may be ragged against their tiles.
"""

from __future__ import annotations

import jax.numpy as jnp

from quant.gmm import kernel
from quant.gmm import target
from quant.gmm import tiles as tiles_lib


def interpret() -> bool:
  """Interpret mode unless the program is compiled for TPU (where Mosaic compiles the kernel)."""
  return target.platform() != "tpu"


def _pad_rows(x, rows: int):
  return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0))) if rows > x.shape[0] else x


def _fitted(tiling: kernel.Tiling | None, m: int, k: int, n: int, *dtypes) -> tuple[kernel.Tiling, int]:
  """The tiling (`tiles.auto` for the target chip's VMEM for None) capped to the problem, and the rows padded to
  its row tile."""
  if tiling is None:
    tiling = tiles_lib.auto(m, k, n, vmem=target.vmem_bytes() if not interpret() else None,
                            dtypes=(dtypes[0], dtypes[1], jnp.float32))
  fitted = tiling.fit(m, k, n, kernel.row_multiple(*dtypes))
  return fitted, -(-m // fitted.tm) * fitted.tm


def matmul(lhs, rhs, group_sizes, *, tiling: kernel.Tiling | None, transpose_rhs: bool = False, row_scale=None,
           col_scale=None, out_dtype=jnp.float32):
  """`lhs[r] @ rhs[g(r)]` (`.T` with transpose_rhs) times `row_scale[r]` and `col_scale[n]`, rounded once to
  `out_dtype` by the kernel, which also stores the zeros of the rows past the groups (`kernel.gmm`'s `zero_tail`)."""
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  fitted, rows = _fitted(tiling, m, k, n, lhs.dtype, rhs.dtype)
  if row_scale is not None:
    row_scale = _pad_rows(jnp.reshape(row_scale, (-1, 1)), rows) if row_scale.size > 1 else (
        jnp.broadcast_to(jnp.reshape(row_scale, (1, 1)), (rows, 1)))
  if col_scale is not None:
    col_scale = jnp.broadcast_to(jnp.reshape(col_scale, (1, -1)), (1, n))
  out = kernel.gmm(_pad_rows(lhs, rows), rhs, group_sizes.astype(jnp.int32), row_scale, col_scale,
                   out_dtype=jnp.dtype(out_dtype), tiling=fitted, transpose_rhs=transpose_rhs, interpret=interpret(),
                   zero_tail=True)
  return out[:m]


def outer(lhs, grad, group_sizes, *, tiling: kernel.Tiling | None, col_scale=None, out_dtype=jnp.float32):
  """Per group `lhs[rows of g]^T grad[rows of g]` -> [G, K, N] times `col_scale[n]`, rounded once to `out_dtype`;
  empty groups give 0."""
  m, k = lhs.shape
  n = grad.shape[1]
  fitted, rows = _fitted(tiling, m, k, n, lhs.dtype, grad.dtype)
  if col_scale is not None:
    col_scale = jnp.broadcast_to(jnp.reshape(col_scale, (1, -1)), (1, n))
  return kernel.tgmm(_pad_rows(lhs, rows), _pad_rows(grad, rows), group_sizes.astype(jnp.int32), col_scale,
                     out_dtype=jnp.dtype(out_dtype), tiling=fitted, interpret=interpret())
