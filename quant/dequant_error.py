"""The dequantization error of a quantized array, reduced per block inside the quantizer's compiled step.

The error of an element is |qvalue × scale − source| in float32 (the quantized value and its scale as stored, the
source as read, each cast to float32). Each function returns two float32 arrays with one value per block of the
quantization (a channel, a 128 × 128 tile, a group of 32): the largest error in the block and the sum of its
errors. They are small beside the qvalue (the block's scale shape), so that an accelerator hands back only them;
the ratio to the block's absmax and the sums over blocks are taken by the caller (`manifest.tally`). The maximum
propagates NaN, as numpy's does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from quant.microscaling import E2M1_VALUES

CHUNK_BYTES = 16 << 20  # float32 error held at once by `channel_figures`


def _reduced(error, axes: tuple[int, ...]):
  return jnp.max(error, axis=axes, keepdims=True), jnp.sum(error, axis=axes, keepdims=True)


def _product(values, scale):
  """`values` × `scale` rounded to float32 before anything is subtracted from it: XLA on the CPU would otherwise
  fuse the product and the subtraction into one FMA, rounding once (numpy, and the manifest's definition, round
  the dequantized value first). The select keeps every value, NaN included, and is not folded away."""
  product = values * scale
  return jnp.where(jnp.isnan(product), jnp.float32(jnp.nan), product)


def channel_figures(source, qvalue, scale, qtype=None):
  """(largest, sum) of the error of `qvalue` × `scale` against `source` over every axis `scale` shares (size 1),
  each of `scale`'s shape (Qwix's per-channel layout). `qvalue` is the quantized array, or with `qtype` its bytes
  (uint8) viewed as that type run by run: XLA on the CPU computes in float16 where an array is float8, and converts
  a whole float8 operand of the loop below before it (a float16 copy, twice the qvalue's size), while bytes stay as
  they are until each run is read. The error is taken in runs of the first axis of at most `CHUNK_BYTES` of
  float32 (a loop), so that the step's temporaries stay that small: as one array XLA on the CPU holds the whole
  float32 error, four times the qvalue, in fresh pages at every call."""
  shared = tuple(a for a in range(source.ndim) if scale.shape[a] == 1)
  scale = scale.astype(jnp.float32)

  def reduced(x, q, s):
    if qtype is not None:
      q = jax.lax.bitcast_convert_type(q, qtype)
    return _reduced(jnp.abs(_product(q.astype(jnp.float32), s) - x.astype(jnp.float32)), shared)

  if not source.ndim:
    return reduced(source, qvalue, scale)
  rows = source.shape[0]
  row_bytes = 4 * math.prod(source.shape[1:])
  run = max([d for d in range(1, rows + 1) if rows % d == 0 and d * row_bytes <= CHUNK_BYTES] or [1])
  runs = lambda a: a.reshape((rows // run, run) + a.shape[1:])  # noqa: E731
  qvalue = jax.lax.optimization_barrier(qvalue)  # the error from the stored qvalue, not from its producer again
  if 0 in shared:  # every run shares the scale: the runs' figures reduced over the runs
    largest, total = jax.lax.map(lambda xq: reduced(*xq, scale), (runs(source), runs(qvalue)))
    return jnp.max(largest, axis=0), jnp.sum(total, axis=0)
  largest, total = jax.lax.map(lambda xqs: reduced(*xqs), (runs(source), runs(qvalue), runs(scale)))
  return largest.reshape(scale.shape), total.reshape(scale.shape)


def block_figures(source, qvalue, scale, block: tuple[int, int]):
  """(largest, sum) of the error per `block` tile of the last two axes (edge tiles smaller), each of `scale`'s
  shape (DeepSeek's 128 × 128 `weight_scale_inv`)."""
  rows, cols = block
  grid = scale.shape[-2:]
  pad = [(0, 0)] * (source.ndim - 2) + [(0, grid[0] * rows - source.shape[-2]), (0, grid[1] * cols - source.shape[-1])]
  tiled = scale.shape[:-2] + (grid[0], rows, grid[1], cols)
  x = jnp.pad(source.astype(jnp.float32), pad).reshape(tiled)  # the padding is 0 against 0: no error
  q = jnp.pad(qvalue.astype(jnp.float32), pad).reshape(tiled)
  error = jnp.abs(_product(q, scale.astype(jnp.float32)[..., :, None, :, None]) - x)
  largest, total = _reduced(error, (error.ndim - 3, error.ndim - 1))
  return largest.reshape(scale.shape), total.reshape(scale.shape)


def group_figures(source, packed, codes, group: int):
  """(largest, sum) of the error per `group` consecutive values of the last axis of packed e2m1 bytes times their
  e8m0 scale `codes` (DeepSeek-V4's FP4 experts), each of `codes`' shape."""
  packed = packed.astype(jnp.uint8)
  nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(source.shape)
  values = jnp.asarray(E2M1_VALUES)[nibbles.astype(jnp.int32)]
  scale = jax.lax.bitcast_convert_type(codes.astype(jnp.int32) << 23, jnp.float32)  # 2^(code - 127), code >= 1
  grouped = source.shape[:-1] + (source.shape[-1] // group, group)
  error = jnp.abs(_product(values.reshape(grouped), scale[..., None]) - source.astype(jnp.float32).reshape(grouped))
  largest, total = _reduced(error, (error.ndim - 1,))
  return largest[..., 0], total[..., 0]
