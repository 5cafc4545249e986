"""Quotients computed as XLA computes them on a CPU, bit for bit on every backend, so a TPU quantizes as a CPU does.

On a CPU, XLA divides by a constant or by a broadcast value as a multiplication by the float32 reciprocal (its
algebraic simplifier rewrites it; measured: 0 of 262,144 quotients differ), divides same-shape arrays exactly
rounded, and rounds each bf16 result to bf16. A TPU's float32 division can be a unit in the last place off, and XLA
there may keep a bf16 intermediate in float32 (excess precision): either moves an occasional value across an FP8
rounding boundary, so the same weight quantized on a TPU and on a CPU gave other fp8 codes (6.8% of them in a dense
weight on a TPU v5e). `divide` corrects the float32 quotient to the nearest by its exact residual (Dekker's
two-product, plain float32 operations); `quotient` and `by_constant` multiply by such a reciprocal, as the CPU does;
each rounds once to the result dtype with `lax.reduce_precision`, which XLA keeps. Traced for a CPU they are the
plain divisions (XLA's own choice there is the reference), elsewhere the emulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SPLIT = 4097.0  # 2**12 + 1: splits a float32 significand into two halves of 12 bits (Veltkamp)
_BITS = {jnp.dtype(jnp.bfloat16): (8, 7)}  # exponent and mantissa bits of the narrow dtypes rounded explicitly


def _split(x):
  c = _SPLIT * x
  hi = c - (c - x)
  return hi, x - hi


def _residual(a, q, b):
  """a - q * b, exactly (q * b = p + e exactly, and a - p is exact where p is within a factor 2 of a)."""
  p = q * b
  qh, ql = _split(q)
  bh, bl = _split(b)
  e = ((qh * bh - p) + qh * bl + ql * bh) + ql * bl
  return (a - p) - e


def _nearest(a, b, q):
  """q, or its neighbour toward a / b, whichever is nearer a / b (a quotient of two floats is never a tie)."""
  r = _residual(a, q, b)
  up = (r > 0) == (b > 0)
  n = jnp.nextafter(q, jnp.where(up, jnp.inf, -jnp.inf).astype(q.dtype))
  rn = _residual(a, n, b)
  return jnp.where((r != 0) & jnp.isfinite(n) & (jnp.abs(rn) < jnp.abs(r)), n, q)


def _on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def divide(a, b, dtype):
  """a / b rounded to nearest (ties to even) in `dtype` (float32, or bf16 through a float32 quotient rounded once, as a
  CPU divides bf16), the same bits on every backend; other dtypes divide as they are."""
  dtype = jnp.dtype(dtype)
  if _on_cpu() or (dtype != jnp.float32 and dtype not in _BITS):
    return (jnp.asarray(a).astype(dtype) / jnp.asarray(b).astype(dtype)).astype(dtype)
  return emulated_divide(a, b, dtype)


def emulated_divide(a, b, dtype):
  """`divide` as the emulation computes it on any backend (float32 or bf16 `dtype`)."""
  dtype = jnp.dtype(dtype)
  a32, b32 = jnp.asarray(a).astype(jnp.float32), jnp.asarray(b).astype(jnp.float32)
  q = _nearest(a32, b32, _nearest(a32, b32, a32 / b32))  # twice: a quotient within two units in the last place
  return _reduced(q, dtype)


def quotient(x, scale):
  """x / scale (scale broadcast against x, or of x's shape) in x's dtype, as XLA computes it on a CPU."""
  x, scale = jnp.asarray(x), jnp.asarray(scale).astype(jnp.asarray(x).dtype)
  if _on_cpu() or x.dtype not in (jnp.float32, *_BITS):
    return x / scale
  return emulated_quotient(x, scale)


def emulated_quotient(x, scale):
  """`quotient` as the emulation computes it on any backend (the float32 reciprocal, one rounding)."""
  if scale.shape == x.shape:
    return emulated_divide(x, scale, x.dtype)
  reciprocal = emulated_divide(jnp.ones((), jnp.float32), scale, jnp.float32)
  return _reduced(x.astype(jnp.float32) * reciprocal, x.dtype)


def by_constant(x, constant: float):
  """x / constant as XLA computes a division by a constant (x times the float32 reciprocal, as a CPU rounds it),
  rounded to x's dtype on every backend; float64 divides."""
  x = jnp.asarray(x)
  if _on_cpu() or x.dtype == jnp.float64:
    return x / constant
  return emulated_by_constant(x, constant)


def emulated_by_constant(x, constant: float):
  """`by_constant` as the emulation computes it on any backend."""
  x = jnp.asarray(x)
  reciprocal = np.float32(1.0) / np.float32(constant)
  return _reduced(x.astype(jnp.float32) * reciprocal, x.dtype)


def rounded(x, dtype):
  """x rounded to `dtype` where XLA keeps the rounding (a bf16 result it would otherwise hold in float32 off a CPU)."""
  if _on_cpu():
    return x.astype(dtype)
  return _reduced(x, dtype)


def _reduced(x, dtype):
  dtype = jnp.dtype(dtype)
  if dtype not in _BITS:
    return x.astype(dtype)
  return jax.lax.reduce_precision(x.astype(jnp.float32), *_BITS[dtype]).astype(dtype)
