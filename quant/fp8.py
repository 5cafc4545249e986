"""FP8 (and int8) quantization numerics: calibration, scales, saturating casts and DeepSeek-style block scales.

`quantize` follows Qwix 0.1.8's dynamic-range quantization step for step (same dtype of every intermediate),
so scales and fp8 or int8 values are bit-identical to `qwix.quantize_api`:

* calibration reduces every axis that is not channelwise (`absmax[,f]`, `rms,f`, `fixed,<hi>` or
  `fixed,<lo>,<hi>` with lo == -hi; `fixed` is always per-tensor), computed in the input's dtype;
* `scale = absmax / bound`: finfo(qtype).max for fp8 (448 for e4m3fn, 57344 for e5m2), iinfo.max + 0.5 for int8
  (127.5: Qwix's symmetric bound, so that the top bucket is as wide as the others); scales below
  sqrt(finfo.tiny) — all-zero channels — become 1;
* fp8: `qvalue = clip(x / scale, finfo.min, finfo.max).astype(qtype)`: values beyond the range saturate, NaN stays
  NaN (an inf input makes its channel's scale inf, hence NaN after dequantization, as in Qwix);
* int8: `qvalue = round(x / scale).astype(int8)` (half to even; the cast saturates at ±127 where x / scale rounds
  to 128, NaN becomes 0), as Qwix does.

Asymmetric calibrations (`minmax`, `fixed,<lo>,<hi>` with lo != -hi) need integer qtypes and are rejected.
"""

import math

import jax.numpy as jnp
import numpy as np

from quant import calibration as calibration_lib
from quant import errors
from quant import rounding
from quant import microscaling_quantize

_QTYPES = {
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "e4m3fn": jnp.float8_e4m3fn,
    "e4m3": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "e5m2": jnp.float8_e5m2,
    "fp8_e5m2": jnp.float8_e5m2,
}
_INT_QTYPES = {"int8": jnp.int8}
_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def resolve_qtype(qtype, *, integers: bool = False) -> np.dtype:
  """Returns the numpy dtype of an fp8 qtype given as a dtype or a name (e.g. 'e4m3', 'float8_e5m2'); with
  `integers`, int8 too (the channelwise quantizers take it; DeepSeek's block layouts do not)."""
  names = {**_QTYPES, **(_INT_QTYPES if integers else {})}
  if isinstance(qtype, str):
    resolved = names.get(qtype.strip().lower())
  else:
    try:
      resolved = np.dtype(qtype)
    except TypeError:
      resolved = None
  if resolved is None or np.dtype(resolved) not in {np.dtype(d) for d in names.values()}:
    accepted = "float8_e4m3fn, float8_e5m2" + (", int8" if integers else "")
    raise errors.QuantError(f"unsupported quantization type {_name(qtype)!r}; accepted: {accepted}")
  return np.dtype(resolved)


def _name(qtype):
  """`int4` for jnp.int4 (a dtype's name where it has one), else the value as given."""
  try:
    return qtype if isinstance(qtype, str) else np.dtype(qtype).name
  except TypeError:
    return qtype


def bound(qtype) -> float:
  """The largest magnitude a scale maps absmax to: finfo.max for fp8, iinfo.max + 0.5 for int8 (Qwix's)."""
  qtype = resolve_qtype(qtype, integers=True)
  if qtype.kind == "i":
    return float(np.iinfo(qtype).max) + 0.5
  return float(jnp.finfo(qtype).max)


def _check_float(x) -> None:
  if np.dtype(x.dtype).name not in _FLOAT_DTYPES:
    raise errors.QuantError(f"cannot quantize an array of dtype {x.dtype}; accepted: {', '.join(_FLOAT_DTYPES)}")


def _normalize_axes(axes, ndim: int) -> tuple[int, ...]:
  out = []
  for axis in axes:
    if not -ndim <= axis < ndim:
      raise errors.QuantError(f"channelwise axis {axis} is out of range for an array of rank {ndim}")
    out.append(axis % ndim)
  return tuple(sorted(set(out)))


def compute_scale(x, qtype, channelwise_axes=(), calibration: str = "absmax"):
  """Returns the quantization scale of `x` (dtype of `x`, rank of `x`, 1 on reduced axes)."""
  x = jnp.asarray(x)
  _check_float(x)
  qtype = resolve_qtype(qtype, integers=True)
  method, args = calibration_lib.parse_calibration(calibration)
  if method == "absmax":
    return scale_from_absmax(absmax(x, channelwise_axes), qtype, calibration)
  reduce_axes = _reduce_axes(channelwise_axes, x.ndim)
  if method == "rms":
    limit = jnp.sqrt(jnp.mean(jnp.square(x), axis=reduce_axes, keepdims=True)) * args[0]
  else:  # fixed: per-tensor
    limit = jnp.full((1,) * x.ndim, args[1], x.dtype)
  return _scale_from_bound(limit, qtype)


def absmax(x, channelwise_axes=()):
  """max |x| over every axis but `channelwise_axes` (kept, size 1 on the others): the absmax calibration's
  statistic. The maximum of the absmaxes of blocks that tile the reduced axes is the absmax of the whole."""
  x = jnp.asarray(x)
  _check_float(x)
  return jnp.max(jnp.abs(x), axis=_reduce_axes(channelwise_axes, x.ndim), keepdims=True)


def scale_from_absmax(amax, qtype, calibration: str = "absmax"):
  """The scale `compute_scale` gives for an absmax calibration (`absmax` or `absmax,<factor>`) from the statistic
  `absmax(x, ...)`: bit for bit the same however the absmax was gathered."""
  method, args = calibration_lib.parse_calibration(calibration)
  if method != "absmax":
    raise errors.QuantError(f"calibration {calibration!r} is not an absmax calibration; accepted: absmax, "
                            "absmax,<factor>")
  limit = jnp.asarray(amax)
  if args:
    limit = rounding.rounded(limit * args[0], limit.dtype)
  return _scale_from_bound(limit, resolve_qtype(qtype, integers=True))


def _reduce_axes(channelwise_axes, ndim: int) -> tuple[int, ...]:
  keep = _normalize_axes(channelwise_axes, ndim)
  return tuple(a for a in range(ndim) if a not in keep)


def _scale_from_bound(value, qtype):
  value = jnp.asarray(value)
  scale = rounding.by_constant(value, bound(qtype))
  tiny_sqrt = jnp.sqrt(jnp.finfo(scale.dtype).tiny)
  return jnp.where(scale < tiny_sqrt, jnp.ones_like(scale), scale)


def quantize_with_scale(x, qtype, scale):
  """Returns `clip(x / scale, finfo.min, finfo.max)` cast to an fp8 `qtype`, or `round(x / scale)` cast to int8
  (division in the dtype of `x`)."""
  x = jnp.asarray(x)
  qtype = resolve_qtype(qtype, integers=True)
  q = rounding.quotient(x, scale)  # as XLA computes it on a CPU, on every backend
  if qtype.kind == "i":
    return jnp.round(q).astype(qtype)
  info = jnp.finfo(qtype)
  return jnp.clip(q, info.min.astype(x.dtype), info.max.astype(x.dtype)).astype(qtype)


def quantize(x, qtype, channelwise_axes=(), calibration: str = "absmax", scale_dtype=None):
  """Quantizes `x` to fp8 or int8 with one scale per index of `channelwise_axes` (none: per-tensor).

  Args:
    x: floating array (bf16, f16, f32, f64).
    qtype: float8_e4m3fn, float8_e5m2 or int8 (dtype or name).
    channelwise_axes: axes that keep their own scales; all other axes are reduced.
    calibration: one of `calibration_lib.CALIBRATIONS`.
    scale_dtype: dtype of the returned scale (default: dtype of `x`; computed in the dtype of `x` regardless).

  Returns:
    (qvalue, scale): qvalue has x's shape and dtype `qtype`; scale has x's rank with reduced axes of size 1, so
    `dequantize(qvalue, scale) ≈ x`.
  """
  x = jnp.asarray(x)
  scale = compute_scale(x, qtype, channelwise_axes, calibration)
  qvalue = quantize_with_scale(x, qtype, scale)
  if scale_dtype is not None:
    scale = scale.astype(scale_dtype)
  return qvalue, scale


def dequantize(qvalue, scale):
  """Returns `qvalue * scale` in the scale's dtype (scale broadcasts against qvalue)."""
  scale = jnp.asarray(scale)
  return jnp.asarray(qvalue).astype(scale.dtype) * scale


def _check_block(block) -> tuple[int, int]:
  try:
    rows, cols = (int(b) for b in block)
  except (TypeError, ValueError):
    rows = cols = 0
  if rows < 1 or cols < 1:
    raise errors.QuantError(f"invalid block shape {block!r}; accepted: two positive integers, e.g. (128, 128)")
  return rows, cols


def block_scale_shape(shape, block=(128, 128)) -> tuple[int, ...]:
  """Shape of the per-block scale of an array: last two dims divided by the block (rounded up)."""
  rows, cols = _check_block(block)
  if len(shape) < 2:
    raise errors.QuantError(f"block quantization needs an array of rank >= 2, got shape {tuple(shape)}")
  return tuple(shape[:-2]) + (math.ceil(shape[-2] / rows), math.ceil(shape[-1] / cols))


def block_quantize(w, block=(128, 128), qtype="float8_e4m3fn", power_of_two: bool = False):
  """Quantizes the last two axes of `w` in blocks, DeepSeek-V3 serving style.

  Each `block[0] x block[1]` tile of the last two axes (edge tiles may be smaller) gets one float32 scale
  `absmax(tile) / finfo(qtype).max` (an all-zero tile gets 1); leading axes (layers, experts) are batch axes.
  `power_of_two` (`scale_fmt: ue8m0`, DeepSeek-V3.1 and V4): the scale is rounded up to a power of two
  (`quant.microscaling_quantize.pow2_ceil`), so no value saturates and each division is exact.

  Returns:
    (qvalue, scale_inv): qvalue has w's shape and dtype `qtype`; scale_inv is float32 of
    `block_scale_shape(w.shape, block)`. The serving convention dequantizes by multiplying:
    `block_dequantize(qvalue, scale_inv, block) ≈ w`.
  """
  w = jnp.asarray(w)
  _check_float(w)
  qtype = resolve_qtype(qtype)
  rows, cols = _check_block(block)
  scale_shape = block_scale_shape(w.shape, block)
  w32 = w.astype(jnp.float32)
  pad = [(0, 0)] * (w.ndim - 2) + [(0, scale_shape[-2] * rows - w.shape[-2]),
                                    (0, scale_shape[-1] * cols - w.shape[-1])]
  tiles = jnp.pad(w32, pad).reshape(scale_shape[:-2] + (scale_shape[-2], rows, scale_shape[-1], cols))
  scale = compute_scale(tiles, qtype, channelwise_axes=tuple(range(w.ndim - 2)) + (w.ndim - 2, w.ndim))
  if power_of_two:
    scale = microscaling_quantize.pow2_ceil(scale)
  qtiles = quantize_with_scale(tiles, qtype, scale)
  qvalue = qtiles.reshape(w32.shape[:-2] + (scale_shape[-2] * rows, scale_shape[-1] * cols))
  qvalue = qvalue[..., :w.shape[-2], :w.shape[-1]]
  return qvalue, scale.reshape(scale_shape)


def block_dequantize(qvalue, scale_inv, block=(128, 128), dtype=jnp.float32):
  """Inverse of `block_quantize`: multiplies every block by its scale, returning `dtype`."""
  qvalue = jnp.asarray(qvalue)
  scale_inv = jnp.asarray(scale_inv, jnp.float32)
  rows, cols = _check_block(block)
  expected = block_scale_shape(qvalue.shape, block)
  if tuple(scale_inv.shape) != expected:
    raise errors.QuantError(
        f"scale_inv shape {tuple(scale_inv.shape)} does not fit values of shape {tuple(qvalue.shape)} with "
        f"block {tuple(block)}; expected {expected}")
  full = jnp.repeat(jnp.repeat(scale_inv, rows, axis=-2), cols, axis=-1)
  full = full[..., :qvalue.shape[-2], :qvalue.shape[-1]]
  return (qvalue.astype(jnp.float32) * full).astype(dtype)
