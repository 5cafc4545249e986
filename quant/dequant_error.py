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

CHUNK_BYTES = 16 << 20  # float32 of the source a run of `channel_figures` / `quantized_with_figures` takes


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
  each of `scale`'s shape (Qwix's per-channel layout), taken run by run (`_in_runs`). With `qtype`, `qvalue` is its
  bytes (`as_bits`), viewed as `qtype` run by run: XLA's CPU code keeps a float8 array that enters a loop as float16,
  converted whole before it (a copy twice the qvalue's size, fresh pages at every call)."""
  qvalue = jax.lax.optimization_barrier(qvalue)  # the error from the stored qvalue, not from its producer again

  def run(x, s, q):
    return None, _channel_error(x, q if qtype is None else jax.lax.bitcast_convert_type(q, qtype), s)

  return _in_runs(run, source, scale, qvalue, squeeze=False)[1]


def quantized_with_figures(source, scale, quantize):
  """(qvalue, (largest, sum)): `quantize(run, its scale)` run by run, with the error figures of `channel_figures`
  taken from each run's qvalue in the same loop. The qvalue comes back without the source's axes of size 1 (for
  the caller to reshape: a free view in numpy), a float8 one as its bytes (uint8): XLA on the CPU
  keeps a float8 array of a loop as float16, converted whole before or after it. Done inside the loop, neither the
  cast source, nor a float16 copy, nor the qvalue a second time is held beside the slice: XLA's CPU code holds its
  temporaries in fresh pages at every call, which took a third of the export's quantizing time."""

  def run(x, s):
    q = quantize(x, s)
    bits = jax.lax.optimization_barrier(as_bits(q))  # the error from the stored bytes: on a TPU, XLA (excess
    # precision allowed) would otherwise skip the float8 rounding of the values it still holds
    stored = jax.lax.bitcast_convert_type(bits, q.dtype) if bits.dtype != q.dtype else bits
    return bits, _channel_error(x, stored, s)

  return _in_runs(run, source, scale)


def as_bits(qvalue):
  """A float8 `qvalue` as its bytes (uint8); any other as it is."""
  if jnp.dtype(qvalue.dtype).itemsize == 1 and jnp.issubdtype(qvalue.dtype, jnp.floating):
    return jax.lax.bitcast_convert_type(qvalue, jnp.uint8)
  return qvalue


def _channel_error(x, q, s):
  """(largest, sum) of |q × s − x| in float32 over the axes where `s` has size 1."""
  shared = tuple(a for a in range(x.ndim) if s.shape[a] == 1)
  error = jnp.abs(_product(q.astype(jnp.float32), s.astype(jnp.float32)) - x.astype(jnp.float32))
  return _reduced(error, shared)


def _in_runs(fn, source, scale, *others, squeeze: bool = True):
  """`fn(run of source, its scale, runs of others)` -> (array of the run's shape or None, (largest, sum)) over runs
  of the first axis of at most `CHUNK_BYTES` of float32 (a loop), so that the step's temporaries stay that small:
  as one array XLA on the CPU holds the whole float32 error, four times the qvalue. Returns the runs' arrays put
  back together, without the source's axes of size 1 unless not `squeeze` (the figures' sums then keep the order
  they had before there were runs' arrays), and the figures, each of `scale`'s shape."""
  if not source.ndim:
    return fn(source, scale, *others)
  ones = tuple(a for a in range(source.ndim) if source.shape[a] == 1)
  if squeeze and ones and len(ones) < source.ndim:  # put back, XLA's CPU layouts may copy the whole result
    out, (largest, total) = _in_runs(fn, *(jnp.squeeze(a, ones) for a in (source, scale) + others))
    return out, (largest.reshape(scale.shape), total.reshape(scale.shape))
  rows = source.shape[0]
  row_bytes = 4 * math.prod(source.shape[1:])
  run = max([d for d in range(1, rows + 1) if rows % d == 0 and d * row_bytes <= CHUNK_BYTES] or [1])
  runs = lambda a: a.reshape((rows // run, run) + a.shape[1:])  # noqa: E731
  cut = tuple(map(runs, others))
  if scale.shape[0] == 1:  # every run shares the scale: the runs' figures reduced over the runs
    out, (largest, total) = jax.lax.map(lambda xo: fn(xo[0], scale, *xo[1:]), (runs(source),) + cut)
    largest, total = jnp.max(largest, axis=0), jnp.sum(total, axis=0)
  else:
    out, (largest, total) = jax.lax.map(lambda xso: fn(*xso), (runs(source), runs(scale)) + cut)
    largest, total = largest.reshape(scale.shape), total.reshape(scale.shape)
  return (None if out is None else out.reshape(source.shape)), (largest, total)


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
