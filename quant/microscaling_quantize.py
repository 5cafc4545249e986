"""The quantizers of `quant.microscaling`'s formats, in `jax.numpy` (they run under `jit`): e2m1 codes and their
packing, power-of-two (e8m0) scales, and DeepSeek-V4's FP4 routed experts (`fp4_quantize`). The rounding, zero and
saturation rules are `quant.microscaling`'s."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from quant import errors
from quant.microscaling import E2M1_MAX, FP4_GROUP, MIN_SCALE_EXPONENT, THRESHOLDS


def e2m1_encode(x) -> jnp.ndarray:
  """uint8 e2m1 codes (0..15) of float values: nearest, ties to even, saturating at ±6, the sign kept."""
  x = jnp.asarray(x, jnp.float32)
  a = jnp.abs(x)
  code = jnp.zeros(x.shape, jnp.uint8)
  for bound, tie_up in THRESHOLDS:
    code = code + ((a >= bound) if tie_up else (a > bound)).astype(jnp.uint8)
  return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def pack_e2m1(codes) -> jnp.ndarray:
  """(..., 2n) codes → (..., n) bytes: element 2i in the low nibble, 2i+1 in the high one."""
  codes = jnp.asarray(codes, jnp.uint8)
  if codes.shape[-1] % 2:
    raise errors.QuantError(f"e2m1 packing needs an even last axis, got shape {tuple(codes.shape)}")
  return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def pow2_ceil(scale) -> jnp.ndarray:
  """The smallest power of two >= `scale` (float32, positive and finite), at least 2^-126: exact, from the bits."""
  scale = jnp.maximum(jnp.asarray(scale, jnp.float32), np.float32(2.0 ** MIN_SCALE_EXPONENT))
  bits = scale.view(jnp.int32)
  exponent = bits >> 23  # the biased exponent (the sign bit is 0)
  up = (bits & 0x7FFFFF) != 0  # not a power of two: the next one
  return ((exponent + up.astype(jnp.int32)) << 23).view(jnp.float32)


def e8m0_encode(pow2) -> jnp.ndarray:
  """e8m0 codes of float32 powers of two in [2^-126, 2^127] (as `pow2_ceil` gives them): their exponent field."""
  return (jnp.asarray(pow2, jnp.float32).view(jnp.int32) >> 23).astype(jnp.uint8)


def group_scales(absmax, qmax: float) -> jnp.ndarray:
  """Power-of-two scales (float32) of blocks with the given absmax for an element type whose largest value is
  `qmax`: `pow2_ceil(absmax / qmax)`, 1 for an all-zero block."""
  absmax = jnp.asarray(absmax, jnp.float32)
  return jnp.where(absmax > 0, pow2_ceil(absmax / np.float32(qmax)), np.float32(1.0))


def fp4_quantize(w, group: int = FP4_GROUP):
  """(packed bytes (..., cols/2) uint8, e8m0 scale codes (..., cols/group) uint8) of `w` (..., cols): one scale per
  `group` consecutive values of the last axis, values / scale rounded to e2m1 and packed two to a byte."""
  w = jnp.asarray(w, jnp.float32)
  cols = w.shape[-1]
  if cols % group or cols % 2:
    raise errors.QuantError(f"FP4 quantization needs a last axis that is a multiple of {group}, got shape "
                            f"{tuple(w.shape)}")
  groups = w.reshape(w.shape[:-1] + (cols // group, group))
  scale = group_scales(jnp.max(jnp.abs(groups), axis=-1), E2M1_MAX)
  codes = e2m1_encode(groups / scale[..., None]).reshape(w.shape)
  return pack_e2m1(codes), e8m0_encode(scale)
