"""`fp8_export.orbax_writer.OrbaxArrayWriter`: arrays written slice by slice form one Orbax pytree that Orbax's
own checkpointer restores; a failed write is one line naming the reason."""

from __future__ import annotations

import errno
import json

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from inspect_tool.fp8_export import orbax_writer, write_orbax
from quant import errors


def test_slices_of_several_arrays_restore_with_orbax(tmp_path):
  step = tmp_path / "0"
  items = step / "items"
  items.mkdir(parents=True)
  rng = np.random.default_rng(0)
  arrays = {("params", "params", "a", "array", "qvalue"): rng.standard_normal((6, 8)).astype(ml_dtypes.float8_e4m3fn),
            ("params", "params", "a", "array", "scale"): np.ones((1, 8), ml_dtypes.bfloat16),
            ("params", "params", "b"): np.arange(24, dtype=np.float32).reshape(2, 3, 4)}
  writer = orbax_writer.OrbaxArrayWriter(str(items))
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
  writer = orbax_writer.OrbaxArrayWriter("/x/items")
  full = _chained(ValueError("write failed"), OSError(errno.ENOSPC, "No space left on device"))
  with pytest.raises(errors.QuantError) as info:
    writer.write(_Store(full, now=True), (slice(0, 3),), np.ones(3))
  assert str(info.value) == "cannot write '/x/items': no space left on device"


def test_a_failed_background_write_is_reported_by_the_next_write():
  writer = orbax_writer.OrbaxArrayWriter("/x/items")
  writer.write(_Store(PermissionError(errno.EACCES, "Permission denied"), now=False), (), np.ones(3))
  with pytest.raises(errors.QuantError, match="^cannot write '/x/items': permission denied$"):
    writer.write(_Store(None, now=False), (), np.ones(3))


def test_copied_arrays_keep_their_stored_chunks_and_a_missing_chunk_reads_as_zeros(tmp_path):
  """A copy whose slices are whole source chunks is copied as stored (the source's codecs, its chunk bytes); a
  slice with a chunk the source never stored is read decoded (zeros, as tensorstore reads it) and written."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  from inspect_tool.paramtree import tree  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import budget, read  # pylint: disable=import-outside-toplevel

  value = np.arange(48, dtype=np.float32).reshape(8, 6)
  src_items = tmp_path / "src" / "0" / "items"
  src_items.mkdir(parents=True)
  writer = orbax_writer.OrbaxArrayWriter(str(src_items))
  key = ("params", "params", "w")
  plain = {"shape": [8, 6], "data_type": "float32", "fill_value": 0, "codecs": [{"name": "bytes"}],  # uncompressed
           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 6]}}}
  store, = writer.create_many([(key, value.shape, value.dtype, (2, 6), plain)])
  writer.write(store, (slice(0, 6),), value[:6])  # rows 6-7 (chunk c/3/0) never stored
  writer.wait()
  writer.finalize(str(tmp_path / "src" / "0"), "items", complete=False)  # a source with a chunk missing
  source = read.CheckpointSource(str(tmp_path / "src" / "0"), [tree.Leaf(key, value.shape, "float32")])
  jobs = write_orbax.plan_jobs(type("Plan", (), {"weights": {}})(), source, 10**9, held=0)
  jobs = [write_orbax.ArrayJob(jobs[0].leaf, key, None, budget.Slicing(value.shape, (4, 6)), jobs[0].chunk,
                               jobs[0].stored)]
  assert jobs[0].stored is not None and jobs[0].chunk == (2, 6)
  dst = tmp_path / "dst" / "0"
  (dst / "items").mkdir(parents=True)
  out, written = write_orbax.write_arrays(jobs, source, str(dst / "items"))
  out.finalize(str(dst), "items")
  assert written.source_bytes == written.written_bytes == value.nbytes
  expected = value.copy()
  expected[6:] = 0
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(str(dst / "items"))
  np.testing.assert_array_equal(np.asarray(restored["params"]["params"]["w"]), expected)
  def stored(items, name):
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{items}/"}).result()
    return kv.read(f"params.params.w/{name}").result().value
  assert stored(dst / "items", "c/0/0") == stored(src_items, "c/0/0") == value[:2].tobytes()  # copied as stored
  assert json.loads(stored(dst / "items", "zarr.json"))["codecs"] == json.loads(stored(src_items, "zarr.json"))["codecs"]
