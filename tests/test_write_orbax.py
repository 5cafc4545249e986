"""`fp8_export.write_orbax.OrbaxArrayWriter`: arrays written slice by slice form one Orbax pytree that Orbax's
own checkpointer restores; a failed write is one line naming the reason."""

from __future__ import annotations

import errno
import json

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from inspect_tool.fp8_export import write_orbax
from quant import errors


def test_slices_of_several_arrays_restore_with_orbax(tmp_path):
  step = tmp_path / "0"
  items = step / "items"
  items.mkdir(parents=True)
  rng = np.random.default_rng(0)
  arrays = {("params", "params", "a", "array", "qvalue"): rng.standard_normal((6, 8)).astype(ml_dtypes.float8_e4m3fn),
            ("params", "params", "a", "array", "scale"): np.ones((1, 8), ml_dtypes.bfloat16),
            ("params", "params", "b"): np.arange(24, dtype=np.float32).reshape(2, 3, 4)}
  writer = write_orbax.OrbaxArrayWriter(str(items))
  for key, value in arrays.items():
    block = (1,) + value.shape[1:]  # one chunk (and one write) per row
    store = writer.create(key, value.shape, value.dtype, block)
    for row in range(value.shape[0]):
      writer.write(store, (slice(row, row + 1),), value[row:row + 1])
  writer.wait()
  assert writer.written_bytes == 48 + 16 + 96
  writer.finalize(str(step), "items")
  assert list(json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]) == ["items"]
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(str(items))
  for key, value in arrays.items():
    node = restored
    for part in key:
      node = node[part]
    assert node.dtype == value.dtype and node.shape == value.shape
    assert np.asarray(node).tobytes() == value.tobytes()
  with pytest.raises(ValueError, match="twice"):
    writer.create(("params", "params", "b"), (2,), np.float32, (2,))


class _Store:
  """A destination array whose write fails at once (`now`) or in the background (the future's result)."""

  def __init__(self, exc, now):
    self.exc, self.now = exc, now

  def __getitem__(self, index):
    return self

  def write(self, value):
    if self.now:
      raise self.exc
    return self

  def result(self):
    raise self.exc


def _chained(outer, inner):
  try:
    raise outer from inner
  except type(outer) as e:
    return e


def test_a_full_disk_is_one_line():
  writer = write_orbax.OrbaxArrayWriter("/x/items")
  full = _chained(ValueError("write failed"), OSError(errno.ENOSPC, "No space left on device"))
  with pytest.raises(errors.QuantError) as info:
    writer.write(_Store(full, now=True), (slice(0, 3),), np.ones(3))
  assert str(info.value) == "cannot write '/x/items': no space left on device"


def test_a_failed_background_write_is_reported_by_the_next_write():
  writer = write_orbax.OrbaxArrayWriter("/x/items")
  writer.write(_Store(PermissionError(errno.EACCES, "Permission denied"), now=False), (), np.ones(3))
  with pytest.raises(errors.QuantError, match="^cannot write '/x/items': permission denied$"):
    writer.write(_Store(None, now=False), (), np.ones(3))
