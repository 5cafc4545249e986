"""Which kernel runs the grouped matmul: the `gmm_backend` key, its resolution, and the kernels behind it.

* reference: tiled `dot_general`s (`quant.gmm.tiled`); runs anywhere; `auto` on CPU.
* pallas: our Pallas kernel (`quant.gmm.kernel` through `quant.gmm.pallas`): operands in their own dtype (fp8
  and int8 move half the bytes of bf16), scales applied in the kernel; compiled on TPU (`auto` there), interpret
  mode elsewhere.
* megablox: JAX's Pallas Megablox `gmm` / `tgmm` (`quant.gmm.megablox`), the kernel MaxText's is derived from;
  fp8 enters it as bf16 and the scales are applied after it.
* xla: XLA's `ragged_dot_general` (`quant.gmm.ragged`); runs anywhere; `auto` on a GPU without Tokamax.
* tokamax: Tokamax's `ragged_dot_general` (`quant.gmm.ragged`); where the tokamax package is installed;
  `auto` on a GPU with FP8 units and Tokamax.

MaxText's `use_tokamax_backend=true` selects tokamax (then gmm_backend must be auto or tokamax). `matmul` and
`outer` take the operands as they are (fp8 values, unscaled) and their scales; they return the float32 products
times the scales (row scale first, then column scale), rounded once to the output dtype: inside the pallas kernel,
after the kernel elsewhere. `quant.gmm.fp8` quantizes, the same way for all, and masks the rows past the groups where
the kernel has not stored their zeros (`ZERO_TAIL`).
"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp

from quant import compat
from quant import errors
from quant import settings
from quant.gmm import kernel
from quant.gmm import megablox as gmm_megablox
from quant.gmm import pallas as gmm_pallas
from quant.gmm import ragged as gmm_ragged
from quant.gmm import target
from quant.gmm import tiled as gmm_tiled

BACKENDS = settings.GMM_BACKENDS
KERNELS = BACKENDS[1:]
ZERO_TAIL = frozenset({"pallas"})  # `matmul` gives zeros past the groups: no masking pass over the output


def check_name(name: str) -> str:
  if name not in BACKENDS:
    raise errors.QuantError(f"gmm_backend={name!r} is not a grouped-matmul backend; accepted: {', '.join(BACKENDS)}")
  return name


def tokamax_installed() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def _auto(platform: str) -> str:
  if platform == "tpu":
    return "pallas"
  if platform == "gpu":
    return "tokamax" if tokamax_installed() and gmm_ragged.native_fp8() else "xla"
  return "reference"


def requested(name: str = "auto", *, use_tokamax_backend: bool = False) -> str:
  """The backend a model's keys ask for: `gmm_backend`, or tokamax under MaxText's use_tokamax_backend=true."""
  check_name(name)
  if not use_tokamax_backend:
    return name
  if name not in ("auto", "tokamax"):
    raise errors.QuantError(f"gmm_backend={name} contradicts use_tokamax_backend=true; accepted: gmm_backend=auto "
                            "or tokamax with use_tokamax_backend=true")
  return "tokamax"


def resolve(name: str = "auto", *, use_tokamax_backend: bool = False, platform: str | None = None) -> str:
  """The kernel `name` stands for on `platform` (default: the compilation target, `target.platform()`: JAX's
  default backend unless a TPU topology is being compiled for), checked to be available.

  Raises:
    errors.QuantError: an unknown name, a contradiction with use_tokamax_backend, or a backend not installed.
  """
  name = requested(name, use_tokamax_backend=use_tokamax_backend)
  if name == "auto":
    if platform is None:
      platform = target.platform()
    name = _auto(platform)
  if name == "tokamax" and not tokamax_installed():
    raise errors.QuantError("gmm_backend=tokamax needs the tokamax package, which is not installed; accepted: "
                            "gmm_backend=auto, reference, pallas or xla (or install tokamax)")
  if name == "megablox":
    compat.megablox_kernels()  # CompatError when this JAX has no Megablox kernels
  return name


def _reference_dtype(*operands):
  """float32 when an operand is fp8 (exact products), else the operands' promoted dtype."""
  if any(jnp.dtype(x.dtype).itemsize == 1 for x in operands):
    return jnp.float32
  return jnp.result_type(*operands)


def _scaled(out, row_scale, col_scale, out_dtype):
  """float32 products times the row scale, then the column scale, rounded once to `out_dtype`."""
  if row_scale is not None:
    out = out * jnp.reshape(row_scale, (-1, 1)).astype(jnp.float32)
  if col_scale is not None:
    out = out * jnp.reshape(col_scale, (1,) * (out.ndim - 1) + (-1,)).astype(jnp.float32)
  return out.astype(out_dtype)


def matmul(backend: str, lhs, rhs, group_sizes, *, tile_rows: int, strategy: str, tiling: kernel.Tiling | None,
           transpose_rhs: bool = False, row_scale=None, col_scale=None, out_dtype=jnp.float32):
  """`lhs[r] @ rhs[g(r)]` ([M, K] x [G, K, N] -> [M, N]; `rhs[g].T` with transpose_rhs) on `backend`, float32
  products times `row_scale[r]` ([M, 1] or one) and `col_scale[n]` ([N] in any shape), rounded once to `out_dtype`
  (by the Pallas kernel itself: no float32 copy of the output). `tile_rows` and `strategy` tile the reference,
  `tiling` the Pallas kernels.

  Rows past sum(group_sizes) are zeros on the backends of `ZERO_TAIL` (the Pallas kernel stores them), undefined on
  the others: the caller masks them there.
  """
  if backend == "pallas":
    return gmm_pallas.matmul(lhs, rhs, group_sizes, tiling=tiling, transpose_rhs=transpose_rhs,
                             row_scale=row_scale, col_scale=col_scale, out_dtype=out_dtype)
  unscaled = row_scale is None and col_scale is None
  if backend == "reference":
    out = gmm_tiled.matmul(lhs, rhs, group_sizes, tile=tile_rows, strategy=strategy,
                           compute_dtype=_reference_dtype(lhs, rhs), transpose_rhs=transpose_rhs)
  elif backend == "megablox":
    out = gmm_megablox.matmul(lhs, rhs, group_sizes, tiling=tiling, transpose_rhs=transpose_rhs,
                              out_dtype=out_dtype if unscaled else jnp.float32)
  elif backend == "xla":
    out = gmm_ragged.xla_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
  elif backend == "tokamax":
    out = gmm_ragged.tokamax_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
  else:
    raise errors.QuantError(f"grouped-matmul kernel {backend!r} is unknown; accepted: {', '.join(KERNELS)}")
  return _scaled(out, row_scale, col_scale, out_dtype)


def outer(backend: str, lhs, grad, group_sizes, *, tile_rows: int, strategy: str, tiling: kernel.Tiling | None,
          col_scale=None, out_dtype=jnp.float32):
  """Per-group `lhs[rows of g]^T grad[rows of g]` ([M, K], [M, N] -> [G, K, N]) on `backend`, float32 sums times
  `col_scale[n]`, rounded once to `out_dtype`.

  Rows of `grad` past sum(group_sizes) must be zero.
  """
  if backend == "pallas":
    return gmm_pallas.outer(lhs, grad, group_sizes, tiling=tiling, col_scale=col_scale, out_dtype=out_dtype)
  if backend == "reference":
    out = gmm_tiled.outer(lhs, grad, group_sizes, tile=tile_rows, strategy=strategy,
                          compute_dtype=_reference_dtype(lhs, grad))
  elif backend == "megablox":
    out = gmm_megablox.outer(lhs, grad, group_sizes, tiling=tiling,
                             out_dtype=out_dtype if col_scale is None else jnp.float32)
  elif backend == "xla":
    out = gmm_ragged.xla_outer(lhs, grad, group_sizes)
  elif backend == "tokamax":
    out = gmm_ragged.tokamax_outer(lhs, grad, group_sizes)
  else:
    raise errors.QuantError(f"grouped-matmul kernel {backend!r} is unknown; accepted: {', '.join(KERNELS)}")
  return _scaled(out, None, col_scale, out_dtype)
