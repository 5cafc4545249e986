"""`streaming.orbax_writer.OrbaxArrayWriter`: arrays written slice by slice form one Orbax pytree that Orbax's
own checkpointer restores; a failed write is one line naming the reason."""

from __future__ import annotations

import errno
import json
import math

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from inspect_tool.fp8_export import quantize
from inspect_tool.streaming import orbax_writer, write_orbax
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


class _Recorded:
  """A destination array whose writes finish when waited for, in the order recorded in `waited`."""

  def __init__(self):
    self.written, self.waited = [], []

  def __getitem__(self, index):
    return self

  def write(self, value):
    number = len(self.written)
    self.written.append(value.nbytes)
    return type("Future", (), {"result": lambda _: self.waited.append(number)})()


@pytest.mark.parametrize("room", [0, 500, 1000])
def test_writes_stay_in_flight_as_far_as_their_room_holds_them(room):
  """Each write of 100 bytes holds IN_FLIGHT_FACTOR x 100 while in flight: a write first waits for the oldest ones
  until the rest and itself fit in `room` (0: for all of them, one write in flight at a time), in order."""
  store, writer = _Recorded(), orbax_writer.OrbaxArrayWriter("/x/items")
  held = orbax_writer.IN_FLIGHT_FACTOR * 100
  for number in range(8):
    writer.write_slice([(store, (slice(0, 25),), np.ones(25, np.float32))], room)
    in_flight = number + 1 - len(store.waited)
    assert in_flight == min(number + 1, max(1, room // held)) and writer.in_flight_bytes == in_flight * held
    assert store.waited == list(range(len(store.waited)))
  writer.wait()
  assert store.waited == list(range(8)) and writer.in_flight_bytes == 0 and writer.written_bytes == 800


def test_copied_arrays_keep_their_stored_chunks_and_a_missing_chunk_reads_as_zeros(tmp_path):
  """A copy whose slices are whole source chunks is copied as stored (the source's codecs, its chunk bytes); a
  slice with a chunk the source never stored is read decoded (zeros, as tensorstore reads it) and written."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  from inspect_tool.paramtree import tree  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import budget, read  # pylint: disable=import-outside-toplevel

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
  out, written = write_orbax.write_arrays(jobs, source, str(dst / "items"), quantizers=quantize.Quantizers)
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


def _origins(shape, chunk, within=None):
  """Every chunk of the grid `chunk` over `shape` (or over the box `within`) as a tuple of slices: brute force."""
  import itertools  # pylint: disable=import-outside-toplevel

  box = within or tuple(slice(0, d) for d in shape)
  axes = [range(b.start, b.stop, c) for b, c in zip(box, chunk)]
  return [tuple(slice(o, min(o + c, b.stop)) for o, c, b in zip(origin, chunk, box))
          for origin in itertools.product(*axes)]


@pytest.mark.parametrize("shape, grid, inner", [((10, 7), (4, 7), None), ((8, 6), (2, 6), None), ((5,), (5,), None),
                                                ((64, 3, 512, 1280), (64, 1, 512, 256), None),
                                                ((9, 10), (9, 10), (4, 3)), ((20, 10), (8, 10), (3, 4)),
                                                ((16, 8), (8, 8), (4, 8)), ((0, 4), (1, 4), None)])
def test_the_merge_reads_back_the_smallest_chunk(shape, grid, inner):
  """`verify.last_chunk` is, of all the (inner) chunks of the grid, the last one and none is smaller."""
  from inspect_tool.streaming import verify  # pylint: disable=import-outside-toplevel

  chunks = _origins(shape, grid)
  if inner is not None:
    chunks = [part for outer in chunks for part in _origins(shape, inner, outer)]
  if not all(shape):
    assert verify.last_chunk(shape, grid, inner) == tuple(slice(0, d) for d in shape)
    return
  volume = lambda index: math.prod(s.stop - s.start for s in index)  # pylint: disable=unnecessary-lambda-assignment
  assert verify.last_chunk(shape, grid, inner) == chunks[-1]
  assert volume(chunks[-1]) == min(volume(c) for c in chunks)


def test_a_chunk_the_merge_cannot_read_back_is_one_line_naming_the_array(tmp_path):
  """The bytes of the chunk the merge reads back (the last) overwritten on disk after the writes: the read-back
  names the array and the checkpoint is not committed (no `_METADATA`). A listing that fails is one line too."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  from inspect_tool.errors import CheckpointError  # pylint: disable=import-outside-toplevel

  items = tmp_path / "0" / "items"
  items.mkdir(parents=True)
  writer = orbax_writer.OrbaxArrayWriter(str(items))
  value = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
  key = ("params", "params", "w")
  writer.register(key, (32, 64), value.shape, value.dtype)
  store, = writer.create_many([(key, value.shape, value.dtype, (32, 64))])
  writer.write(store, (slice(0, 64),), value)
  writer.wait()
  database = items / "ocdbt.process_0"
  base = ts.KvStore.open(f"file://{database}/").result()
  root = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
  where = {entry["key"]: entry.get("indirect_value") for entry in ts.ocdbt.dump(base, root).result()["entries"]}
  name, offset, length = where[b"params.params.w/c/1/0"].removeprefix("value::").rsplit(":", 2)  # FILE:AT:LENGTH
  with open(database / name, "r+b") as f:
    f.seek(int(offset))
    f.write(bytes(int(length)))
  with pytest.raises(CheckpointError, match=r"^array params/params/w of the merged checkpoint cannot be read back "
                                            r"\(.+\); nothing was committed$"):
    writer.finalize(str(tmp_path / "0"), "items")
  assert not (items / "_METADATA").exists()


def test_a_merged_database_that_cannot_be_listed_is_one_line(tmp_path, monkeypatch):
  """The merged root's B-tree node overwritten between the merge and its check: one line, nothing committed."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  from inspect_tool.errors import CheckpointError  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import verify  # pylint: disable=import-outside-toplevel

  items = tmp_path / "0" / "items"
  items.mkdir(parents=True)
  writer = orbax_writer.OrbaxArrayWriter(str(items))
  key = ("params", "params", "w")
  writer.register(key, (2, 3), (4, 3), np.float32)
  store, = writer.create_many([(key, (4, 3), np.float32, (2, 3))])
  writer.write(store, (slice(0, 4),), np.ones((4, 3), np.float32))
  writer.wait()
  check = verify.check_merged

  def overwrite_the_root_node(*args, **kwargs):
    base = ts.KvStore.open(f"file://{items}/").result()
    location = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
    name, offset, length = location.removeprefix("btreenode::").rsplit(":", 2)
    with open(items / name, "r+b") as f:
      f.seek(int(offset))
      f.write(bytes(int(length)))
    return check(*args, **kwargs)

  monkeypatch.setattr(verify, "check_merged", overwrite_the_root_node)
  with pytest.raises(CheckpointError, match=r"^the merged checkpoint cannot be listed \(.+\); nothing was "
                                            r"committed$"):
    writer.finalize(str(tmp_path / "0"), "items")
  assert not (items / "_METADATA").exists()


def test_the_read_back_holds_no_more_than_its_largest_read(monkeypatch):
  """Reads start while the decoded bytes in flight, with theirs, stay within the largest read's; small ones overlap
  (several in flight), the largest runs alone; all are waited for, and a failure names its array."""
  from inspect_tool.errors import CheckpointError  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import verify  # pylint: disable=import-outside-toplevel

  in_flight, peaks = {}, []

  class Read:
    def __init__(self, name, nbytes, fails):
      self.name, self.fails = name, fails
      in_flight[name] = nbytes
      peaks.append((name, sum(in_flight.values()), len(in_flight)))

    def result(self):
      del in_flight[self.name]
      if self.fails:
        raise ValueError(f"DATA_LOSS: {self.name}\nmore")

  sizes = {"a": 10, "b": 30, "c": 100, "d": 40, "e": 40, "f": 20, "g": 5}
  monkeypatch.setattr(verify, "_read", lambda opened, index: Read(*opened))
  verify._read_back([(name, (), n, (name, n, False)) for name, n in sizes.items()])  # pylint: disable=protected-access
  assert not in_flight and [name for name, _, _ in peaks] == list(sizes)
  assert all(held <= 100 for _, held, _ in peaks)
  assert dict((name, count) for name, _, count in peaks) == {"a": 1, "b": 2, "c": 1, "d": 1, "e": 2, "f": 3, "g": 3}
  checks = [(name, (), n, (name, n, name == "d")) for name, n in sizes.items()]
  with pytest.raises(CheckpointError, match=r"^d cannot be read back \(DATA_LOSS: d\); nothing was committed$"):
    verify._read_back(checks)  # pylint: disable=protected-access
