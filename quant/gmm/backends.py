"""Which kernel runs the grouped matmul: the `gmm_backend` key, its resolution, and the kernels behind it.

* reference: tiled `dot_general`s (`quant.gmm.tiled`); runs anywhere; `auto` on CPU.
* pallas: JAX's Pallas Megablox `gmm` / `tgmm` (`quant.gmm.pallas`); compiled on TPU (`auto` there),
  interpret mode elsewhere.
* xla: XLA's `ragged_dot_general` (`quant.gmm.ragged`); runs anywhere; `auto` on a GPU without Tokamax.
* tokamax: Tokamax's `ragged_dot_general` (`quant.gmm.ragged`); where the tokamax package is installed;
  `auto` on a GPU with FP8 units and Tokamax.

MaxText's `use_tokamax_backend=true` selects tokamax (then gmm_backend must be auto or tokamax). Every kernel
returns float32 products of the operands it is given (fp8 values, unscaled); `quant.gmm.fp8` quantizes, applies
the scales and masks rows past the groups, the same way for all of them.
"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp

from quant import compat
from quant import errors
from quant.gmm import pallas as gmm_pallas
from quant.gmm import ragged as gmm_ragged
from quant.gmm import target
from quant.gmm import tiled as gmm_tiled

BACKENDS = ("auto", "reference", "pallas", "xla", "tokamax")
KERNELS = BACKENDS[1:]


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
  if name == "pallas":
    compat.megablox_kernels()  # CompatError when this JAX has no Megablox kernels
  return name


def _reference_dtype(*operands):
  """float32 when an operand is fp8 (exact products), else the operands' promoted dtype."""
  if any(jnp.dtype(x.dtype).itemsize == 1 for x in operands):
    return jnp.float32
  return jnp.result_type(*operands)


def matmul(backend: str, lhs, rhs, group_sizes, *, tile_rows: int, strategy: str, transpose_rhs: bool = False,
           out_dtype=jnp.float32):
  """`lhs[r] @ rhs[g(r)]` ([M, K] x [G, K, N] -> [M, N]; `rhs[g].T` with transpose_rhs) on `backend`, float32
  products rounded once to `out_dtype` (by the Pallas kernel itself: no float32 copy of the output).

  Rows past sum(group_sizes) are undefined: the caller masks them.
  """
  if backend == "reference":
    return gmm_tiled.matmul(lhs, rhs, group_sizes, tile=tile_rows, strategy=strategy,
                            compute_dtype=_reference_dtype(lhs, rhs), transpose_rhs=transpose_rhs).astype(out_dtype)
  if backend == "pallas":
    return gmm_pallas.matmul(lhs, rhs, group_sizes, tile_rows=tile_rows, transpose_rhs=transpose_rhs,
                             out_dtype=out_dtype)
  if backend == "xla":
    return gmm_ragged.xla_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs).astype(out_dtype)
  if backend == "tokamax":
    return gmm_ragged.tokamax_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs).astype(out_dtype)
  raise errors.QuantError(f"grouped-matmul kernel {backend!r} is unknown; accepted: {', '.join(KERNELS)}")


def outer(backend: str, lhs, grad, group_sizes, *, tile_rows: int, strategy: str, out_dtype=jnp.float32):
  """Per-group `lhs[rows of g]^T grad[rows of g]` ([M, K], [M, N] -> [G, K, N]) on `backend`, float32 sums rounded
  once to `out_dtype`.

  Rows of `grad` past sum(group_sizes) must be zero.
  """
  if backend == "reference":
    return gmm_tiled.outer(lhs, grad, group_sizes, tile=tile_rows, strategy=strategy,
                           compute_dtype=_reference_dtype(lhs, grad)).astype(out_dtype)
  if backend == "pallas":
    return gmm_pallas.outer(lhs, grad, group_sizes, tile_rows=tile_rows, out_dtype=out_dtype)
  if backend == "xla":
    return gmm_ragged.xla_outer(lhs, grad, group_sizes).astype(out_dtype)
  if backend == "tokamax":
    return gmm_ragged.tokamax_outer(lhs, grad, group_sizes).astype(out_dtype)
  raise errors.QuantError(f"grouped-matmul kernel {backend!r} is unknown; accepted: {', '.join(KERNELS)}")
