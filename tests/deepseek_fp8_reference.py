"""Test-side numpy reference of DeepSeek-V3's FP8 weight format (128 × 128 block scales).

Written from the format's definition, independently of `quant/fp8.py`: each block of the last two axes (blocks at
the bottom and right edges are smaller: the block grid is rounded up) gets one float32 `weight_scale_inv =
amax(|block|) / 448`, and the stored value is `clip(w / weight_scale_inv, -448, 448)` cast to float8_e4m3fn (round
to nearest even), so that `w ≈ q * weight_scale_inv`. An all-zero block gets scale 1 (the project's and Qwix's
convention for empty channels; 0/0 would be NaN).

numpy divides with correct IEEE rounding; XLA's float32 division on CPU does not always (a 1-ulp difference in about
half of all quotients), so the library's jitted quantizer may differ from this reference by one ulp in a scale.
"""

import math

import ml_dtypes
import numpy as np

E4M3_MAX = np.float32(448.0)
TINY_SCALE = np.sqrt(np.finfo(np.float32).tiny)


def block_quantize(w, block=(128, 128)):
  """(qvalue float8_e4m3fn, weight_scale_inv float32) of `w`; leading axes are batch axes."""
  w = np.asarray(w, np.float32)
  rows, cols = block
  grid = (math.ceil(w.shape[-2] / rows), math.ceil(w.shape[-1] / cols))
  scale_inv = np.ones(w.shape[:-2] + grid, np.float32)
  qvalue = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for r in range(grid[0]):
    for c in range(grid[1]):
      window = (..., slice(r * rows, (r + 1) * rows), slice(c * cols, (c + 1) * cols))
      tile = w[window]
      scale = np.abs(tile).max(axis=(-2, -1), keepdims=True) / E4M3_MAX
      scale = np.where(scale < TINY_SCALE, np.float32(1.0), scale).astype(np.float32)
      scale_inv[..., r, c] = scale[..., 0, 0]
      qvalue[window] = np.clip(tile / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
  return qvalue, scale_inv


def block_dequantize(qvalue, scale_inv, block=(128, 128)):
  """float32 `q * weight_scale_inv`, each scale repeated over its block."""
  full = np.repeat(np.repeat(scale_inv, block[0], axis=-2), block[1], axis=-1)
  return np.asarray(qvalue, np.float32) * full[..., :qvalue.shape[-2], :qvalue.shape[-1]]


def ulp_distance(a, b):
  """Per-element distance in units in the last place of two float32 arrays of the same sign."""
  return np.abs(np.asarray(a, np.float32).view(np.int32).astype(np.int64)
                - np.asarray(b, np.float32).view(np.int32).astype(np.int64))


def fp8_step_distance(a, b):
  """Per-element distance in float8_e4m3fn steps of two e4m3fn arrays of the same sign."""
  return np.abs(np.asarray(a).view(np.uint8).astype(np.int16) - np.asarray(b).view(np.uint8).astype(np.int16))
