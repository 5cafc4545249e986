"""The dequantization error of each quantized tensor, gathered block by block from the quantizer's own figures.

An element's error is |qvalue × scale − source| in float32; relative to the block's absmax it is that error over
|scale| × the quantized dtype's largest value (the block's absmax as the quantizer's absmax calibration saw it:
scale = absmax / max; for int8 max is Qwix's 127.5). The quantizer's compiled step reduces the errors of each block (a channel, a 128 × 128 tile,
a group of 32) to their largest value and their sum (`quant.dequant_error`); `add` takes those. The relative
figure is exact from them: dividing by one positive absmax keeps the order of a block's errors, so the largest
quotient is the largest error's. Blocks may come from several threads (`add` takes a lock) and from several
processes (`to_json` / `merge`).
"""

from __future__ import annotations

import json
import math
import threading

import numpy as np


class Tally:
  """Per stored tensor name: the largest and summed absolute error, the element count, the largest relative one."""

  def __init__(self):
    self._lock = threading.Lock()
    self._rows: dict[str, list[float]] = {}  # name -> [max_abs, sum_abs, count, max_over_absmax]

  def add(self, name: str, largest, total, count: int, scale, qmax: float) -> None:
    """Adds blocks of tensor `name` holding `count` elements: the largest error of each block (`largest`), their
    sums (`total`, the same shape) and each block's scale (broadcastable to them), whose absmax is |scale| ×
    `qmax` (the quantized dtype's largest value) in float32."""
    largest = np.asarray(largest, np.float32)
    row = [float(largest.max(initial=0.0)), float(np.asarray(total, np.float64).sum()), float(count)]
    absmax = np.abs(np.asarray(scale, np.float32) * np.float32(qmax))
    with np.errstate(divide="ignore", invalid="ignore"):  # absmax 0: inf where the error is not 0, NaN where it is
      ratio = np.divide(largest, absmax, dtype=np.float32)
    row.append(float(np.fmax.reduce(ratio, axis=None, initial=0.0)) if row[0] == row[0] else math.nan)
    with self._lock:
      self._add(name, row)

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

