"""Grouped matmuls as `ragged_dot`: XLA's `jax.lax.ragged_dot_general` and Tokamax's `ragged_dot_general`.

XLA: FP8 operands stay FP8 where the device multiplies FP8 natively (a GPU of compute capability 8.9 or more)
and where XLA lowers ragged_dot on the host (CPU: it converts them itself); elsewhere they enter as bfloat16,
which holds every fp8 value exactly. Products accumulate in float32 and the caller applies the scales.
Tokamax (MaxText's `use_tokamax_backend`): FP8 operands go in as Qwix `QArray`s (the form in which MaxText
hands them to Tokamax, so its FP8 kernels run: Mosaic GPU on Hopper, Mosaic TPU) with unit scales; the caller
applies the real scales to the float32 result, as for the other kernels.
"""

import importlib

import jax
import jax.numpy as jnp
import qwix

FORWARD = jax.lax.RaggedDotDimensionNumbers(  # [M, K] x [G, K, N] -> [M, N]
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
TRANSPOSED = jax.lax.RaggedDotDimensionNumbers(  # [M, N] x [G, K, N] -> [M, K]
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
OUTER = jax.lax.RaggedDotDimensionNumbers(  # [M, K] x [M, N] -> [G, K, N]
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _is_fp8(x) -> bool:
  return jnp.dtype(x.dtype).itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating)


def native_fp8() -> bool:
  """Whether XLA's ragged_dot may take fp8 operands as they are on this backend."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return True
  capability = getattr(device, "compute_capability", None)  # "9.0" on an H100 / H200
  if device.platform == "gpu" and capability:
    major, minor = (int(p) for p in str(capability).split(".")[:2])
    return (major, minor) >= (8, 9)
  return False


def _operands(lhs, rhs):
  if _is_fp8(lhs) and _is_fp8(rhs) and native_fp8():
    return lhs, rhs
  # fp8 values stay fp8 up to their widening: XLA on a TPU would otherwise fold the rounding to fp8 and the widening
  # to bf16 into one conversion that skips the rounding (measured: the unquantized product).
  lhs, rhs = (jax.lax.optimization_barrier(x) if _is_fp8(x) else x for x in (lhs, rhs))
  float_dtype = lambda x, other: other.dtype if _is_fp8(x) and not _is_fp8(other) else (
      jnp.bfloat16 if _is_fp8(x) else x.dtype)
  lhs, rhs = lhs.astype(float_dtype(lhs, rhs)), rhs.astype(float_dtype(rhs, lhs))
  common = jnp.result_type(lhs.dtype, rhs.dtype)
  return lhs.astype(common), rhs.astype(common)


def xla_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
  """float32 `lhs[r] @ rhs[g(r)]` (`.T` with transpose_rhs) with XLA's ragged_dot."""
  lhs, rhs = _operands(lhs, rhs)
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, TRANSPOSED if transpose_rhs else FORWARD,
                                    preferred_element_type=jnp.float32, precision=_precision(lhs))


def xla_outer(lhs, grad, group_sizes):
  """float32 per-group `lhs^T grad` -> [G, K, N] with XLA's ragged_dot."""
  lhs, grad = _operands(lhs, grad)
  return jax.lax.ragged_dot_general(lhs, grad, group_sizes, OUTER, preferred_element_type=jnp.float32,
                                    precision=_precision(lhs))


def _precision(x):
  """HIGHEST for float32 operands (every bit, on an accelerator too), the default for narrower ones."""
  return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _tokamax_operand(x):
  """An fp8 operand as a Qwix QArray of unit scale (the form Tokamax's FP8 kernels take), else the array."""
  if not _is_fp8(x):
    return x

  return qwix.QArray(qvalue=x, scale=jnp.ones((1,) * x.ndim, jnp.float32), zero_point=None, qtype=x.dtype)


def tokamax_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
  """float32 `lhs[r] @ rhs[g(r)]` (`.T` with transpose_rhs) with Tokamax's ragged_dot_general."""
  tokamax = importlib.import_module("tokamax")
  return tokamax.ragged_dot_general(_tokamax_operand(lhs), _tokamax_operand(rhs), group_sizes,
                                    TRANSPOSED if transpose_rhs else FORWARD, preferred_element_type=jnp.float32)


def tokamax_outer(lhs, grad, group_sizes):
  """float32 per-group `lhs^T grad` -> [G, K, N] with Tokamax's ragged_dot_general."""
  tokamax = importlib.import_module("tokamax")
  return tokamax.ragged_dot_general(_tokamax_operand(lhs), _tokamax_operand(grad), group_sizes, OUTER,
                                    preferred_element_type=jnp.float32)
