"""The dequantization error of each quantized tensor, gathered slice by slice while the export quantizes it.

A slice's error is |qvalue × scale − source| in float32, element by element; relative to the block's absmax it is
that error over |scale| × the quantized dtype's largest value (the block's absmax as the quantizer's absmax
calibration saw it: scale = absmax / max; for int8 max is Qwix's 127.5). Slices may come from several threads
(`observe` takes a lock) and from several processes (`to_json` / `merge`).
"""

from __future__ import annotations

import json
import math
import threading

import ml_dtypes
import numpy as np


class Tally:
  """Per stored tensor name: the largest and summed absolute error, the element count, the largest relative one."""

  def __init__(self):
    self._lock = threading.Lock()
    self._rows: dict[str, list[float]] = {}  # name -> [max_abs, sum_abs, count, max_over_absmax]

  def observe(self, name: str, source, dequantized, block_absmax) -> None:
    """Adds one slice of tensor `name`: its `source` values, their `dequantized` stored values (same shape) and the
    absmax of each element's block (broadcastable to that shape)."""
    error = np.abs(np.asarray(dequantized, np.float32) - np.asarray(source, np.float32))
    absmax = np.empty_like(error)
    absmax[...] = np.abs(np.asarray(block_absmax, np.float32))
    self._observe_error(name, error, absmax)

  def _observe_error(self, name: str, error: np.ndarray, absmax: np.ndarray) -> None:
    """Adds the row of `error` (float32, |dequantized - source|) beside `absmax` (float32, >= 0, same shape); both
    are overwritten (the quotient goes into `absmax`)."""
    row = [float(error.max(initial=0.0)), float(error.sum(dtype=np.float64)), float(error.size)]
    with np.errstate(divide="ignore", invalid="ignore"):
      np.divide(error, absmax, out=absmax)  # absmax 0: inf where the error is not 0, NaN where it is (ignored)
    row.append(float(np.fmax.reduce(absmax, axis=None, initial=0.0)) if row[0] == row[0] else math.nan)
    with self._lock:
      self._add(name, row)

  def observe_quantized(self, name: str, source, qvalue, scale, block, band_bytes: int = 4 << 20) -> None:
    """Adds one quantized slice: `qvalue` (the slice's shape) times `scale`, one value per `block` (one side per
    axis; an axis where `scale` has size 1 shares one scale) against `source`, in bands along the first axis of
    about `band_bytes` of float32 each (so that the error's temporaries stay small)."""
    source, qvalue, scale = np.asarray(source), np.asarray(qvalue), np.asarray(scale, np.float32)
    qmax = _absmax_over_scale(qvalue.dtype)
    if source.ndim == 0:
      self.observe(name, source, qvalue.astype(np.float32) * scale, scale * qmax)
      return
    varies = scale.shape[0] > 1
    row = max(1, source[:1].size) * 4
    step = max(1, band_bytes // row)
    if varies and block[0] > 1:
      step = -(-step // block[0]) * block[0]
    lookup = _float32_values(qvalue.dtype)
    # the band's float32 temporaries, allocated once: fresh pages for every band would cost more than the arithmetic
    error, absmax = (np.empty(min(step, source.shape[0]) * max(1, source[:1].size), np.float32) for _ in range(2))
    for begin in range(0, source.shape[0], step):
      end = min(begin + step, source.shape[0])
      part = scale[begin // block[0]:-(-end // block[0])] if varies else scale
      for axis in range(part.ndim):
        if part.shape[axis] > 1 and block[axis] > 1:
          part = np.repeat(part, block[axis], axis=axis)
      shape = (end - begin,) + qvalue.shape[1:]
      part = np.broadcast_to(part[tuple(slice(0, min(d, n)) for d, n in zip(part.shape, shape))], shape)
      band_error, band_absmax = (buffer[:math.prod(shape)].reshape(shape) for buffer in (error, absmax))
      if lookup is None:
        band_error[...] = qvalue[begin:end]
      else:
        np.take(lookup, qvalue[begin:end].view(np.uint8), out=band_error, mode="clip")  # (no buffered copy)
      np.multiply(band_error, part, out=band_error)
      if source.dtype == np.float32:
        np.subtract(band_error, source[begin:end], out=band_error)
      else:
        band_absmax[...] = source[begin:end]
        np.subtract(band_error, band_absmax, out=band_error)
      np.abs(band_error, out=band_error)
      np.multiply(part, qmax, out=band_absmax)
      np.abs(band_absmax, out=band_absmax)
      self._observe_error(name, band_error, band_absmax)

  def observe_shared(self, name: str, source, qvalue, scale) -> None:
    """`observe_quantized` for Qwix's layout: `scale` has the slice's rank, size 1 on every axis it is shared over."""
    self.observe_quantized(name, source, qvalue, scale, (1,) * np.ndim(qvalue))

  def _add(self, name: str, row: list[float]) -> None:
    old = self._rows.get(name)
    self._rows[name] = row if old is None else [max(old[0], row[0]), old[1] + row[1], old[2] + row[2],
                                                max(old[3], row[3])]

  def error(self, name: str) -> dict | None:
    """The error fields of tensor `name`'s manifest entry (None: never observed)."""
    row = self._rows.get(name)
    if row is None:
      return None
    return {"max_abs": row[0], "mean_abs": row[1] / row[2] if row[2] else 0.0, "elements": int(row[2]),
            "max_over_block_absmax": row[3]}

  def to_json(self) -> str:
    return json.dumps(self._rows)

  def merge(self, text: str) -> None:
    """Adds another process's tally (its `to_json`)."""
    for name, row in json.loads(text).items():
      self._add(name, [float(v) for v in row])


def _absmax_over_scale(dtype) -> float:
  """absmax / scale of a block at its largest value: finfo.max of a float qtype, iinfo.max + 0.5 of an integer one
  (Qwix's int8 bound, 127.5)."""
  dtype = np.dtype(dtype)
  if dtype.kind == "i":
    return float(np.iinfo(dtype).max) + 0.5
  return float(ml_dtypes.finfo(dtype).max)


def _float32_values(dtype) -> np.ndarray | None:
  """The float32 value of each of the 256 codes of a one-byte `dtype` (FP8), to cast by lookup: several times
  faster than ml_dtypes' element-wise cast; None for other dtypes."""
  dtype = np.dtype(dtype)
  if dtype.itemsize != 1 or dtype.kind in "iub":
    return None
  return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
