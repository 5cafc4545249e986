"""The dequantization error of each quantized tensor, gathered slice by slice while the export quantizes it.

A slice's error is |qvalue × scale − source| in float32, element by element; relative to the block's absmax it is
that error over |scale| × the quantized dtype's largest value (the block's absmax as the quantizer's absmax
calibration saw it: scale = absmax / max). Slices may come from several threads (`observe` takes a lock) and from
several processes (`to_json` / `merge`).
"""

from __future__ import annotations

import json
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
    source = np.asarray(source, np.float32)
    error = np.abs(np.asarray(dequantized, np.float32) - source)
    absmax = np.broadcast_to(np.abs(np.asarray(block_absmax, np.float32)), error.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
      relative = np.where(absmax > 0, error / absmax, np.where(error > 0, np.inf, 0.0))
    row = [float(error.max(initial=0.0)), float(error.sum(dtype=np.float64)), float(error.size),
           float(relative.max(initial=0.0))]
    with self._lock:
      self._add(name, row)

  def observe_quantized(self, name: str, source, qvalue, scale, block, band_bytes: int = 4 << 20) -> None:
    """Adds one quantized slice: `qvalue` (the slice's shape) times `scale`, one value per `block` (one side per
    axis; an axis where `scale` has size 1 shares one scale) against `source`, in bands along the first axis of
    about `band_bytes` of float32 each (so that the error's temporaries stay small)."""
    source, qvalue, scale = np.asarray(source), np.asarray(qvalue), np.asarray(scale, np.float32)
    qmax = float(ml_dtypes.finfo(qvalue.dtype).max)  # absmax / scale at the block's largest value
    if source.ndim == 0:
      self.observe(name, source, qvalue.astype(np.float32) * scale, scale * qmax)
      return
    varies = scale.shape[0] > 1
    row = max(1, source[:1].size) * 4
    step = max(1, band_bytes // row)
    if varies and block[0] > 1:
      step = -(-step // block[0]) * block[0]
    for begin in range(0, source.shape[0], step):
      end = min(begin + step, source.shape[0])
      part = scale[begin // block[0]:-(-end // block[0])] if varies else scale
      for axis in range(part.ndim):
        if part.shape[axis] > 1 and block[axis] > 1:
          part = np.repeat(part, block[axis], axis=axis)
      part = part[tuple(slice(0, min(d, n)) for d, n in zip(part.shape, (end - begin,) + qvalue.shape[1:]))]
      part = np.broadcast_to(part, (end - begin,) + qvalue.shape[1:])
      self.observe(name, source[begin:end], qvalue[begin:end].astype(np.float32) * part, part * qmax)

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
