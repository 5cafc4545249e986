"""Streamed reads (`streaming/chunk_stream.py`) of arrays Orbax itself saved as one zarr3 chunk: the shard index
gives the stored frame, decoding it front to back into boxes gives numpy's values of the saved arrays, a box behind
the point reached decodes the chunk again, and a damaged frame is one line naming the source."""

from __future__ import annotations

import itertools
import os

import ml_dtypes
import numpy as np
import pytest

from inspect_tool import errors
from inspect_tool.streaming import chunk_stream
from inspect_tool.streaming import read

ARRAYS = {"experts": ((4, 3, 64, 96), ml_dtypes.bfloat16), "dense": ((200, 300), np.float32),
          "vector": ((1000,), np.float32)}


def _save(path: str, *, chunk_byte_size=None, zarr3=True) -> dict:
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(7)
  values = {name: rng.standard_normal(shape, np.float32).astype(dtype) for name, (shape, dtype) in ARRAYS.items()}
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=zarr3)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(path, args=ocp.args.PyTreeSave(
        {k: jnp.asarray(v) for k, v in values.items()},
        save_args={k: ocp.SaveArgs(chunk_byte_size=chunk_byte_size) for k in values}))
  return values


def _open(path: str, name: str, zarr3=True):
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  return ts.open({"driver": "zarr3" if zarr3 else "zarr",
                  "kvstore": {"driver": "ocdbt", "base": f"file://{path}/", "path": name + "/"}}, open=True).result()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("stream") / "items")
  return path, _save(path)


def _stream(path, name):
  store = _open(path, name)
  chunk = chunk_stream.stored_chunk(store.kvstore, store.spec().to_json()["metadata"], store.shape)
  starts = []
  stream = chunk_stream.ChunkStream(store.kvstore, chunk, store.shape, store.dtype.numpy_dtype,
                                    lambda: starts.append(1))
  return store, chunk, stream, starts


def _read(stream, index):
  out = np.empty([s.stop - s.start for s in index], stream.dtype)
  return stream.read_async(index, out).result()


@pytest.mark.parametrize("mapped", [True, False])  # the data file mapped by the stream; read through tensorstore
@pytest.mark.parametrize("window", [None, 4096])  # windows as they are, and many windows per chunk
@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_the_boxes_of_a_one_chunk_array_decode_to_the_saved_values_in_one_pass(saved, name, window, mapped,
                                                                                monkeypatch):
  from inspect_tool.storage import mapped_reads  # pylint: disable=import-outside-toplevel

  path, values = saved
  if window:
    monkeypatch.setattr(chunk_stream, "MAPPED_WINDOW_BYTES" if mapped else "LOCAL_WINDOW_BYTES", window)
  if not mapped:  # as on a network file system
    monkeypatch.setattr(mapped_reads, "allowed", lambda path: False)
  store, chunk, stream, starts = _stream(path, name)
  try:
    assert chunk.zstd and 0 < chunk.nbytes < values[name].nbytes and chunk.window > 0
    if mapped:  # the chunk's bytes in the file are those tensorstore reads at its key
      with open(chunk.file, "rb") as f:
        f.seek(chunk.file_offset)
        assert f.read(chunk.nbytes) == store.kvstore.read(chunk.key).result().value[chunk.offset:][:chunk.nbytes]
      assert chunk.read_bytes == (window or 2**20)
    else:
      assert chunk.file is None and chunk.read_bytes == (window or 256 * 2**10)  # small windows, heap-reused
    assert chunk.held == 2 * min(chunk.read_bytes, chunk.nbytes) + chunk.window + chunk_stream.DECODER_BYTES
    shape = values[name].shape
    box = (1,) * (len(shape) - 1) + (shape[-1],) if len(shape) > 1 else (100,)
    boxes = [tuple(slice(i, i + b) for i, b in zip(corner, box))
             for corner in itertools.product(*(range(0, d, b) for d, b in zip(shape, box)))]
    parts = [_read(stream, index) for index in boxes]
    for index, part in zip(boxes, parts):
      assert part.tobytes() == values[name][index].tobytes()
    assert len(starts) == 1  # the chunk decoded once, front to back
  finally:
    stream.close()


def test_a_box_behind_the_point_reached_decodes_the_chunk_again_and_skipped_runs_are_passed(saved):
  path, values = saved
  _, _, stream, starts = _stream(path, "dense")
  try:
    later = (slice(150, 170), slice(0, 300))
    assert _read(stream, later).tobytes() == values["dense"][later].tobytes()  # rows 0-149 decoded and dropped
    assert len(starts) == 1
    early = (slice(3, 4), slice(10, 200))
    assert _read(stream, early).tobytes() == values["dense"][early].tobytes()
    assert len(starts) == 2
  finally:
    stream.close()


def test_only_runs_of_the_array_in_c_order_are_contiguous():
  shape = (4, 3, 5)
  numbers = np.arange(60).reshape(shape)
  for start in itertools.product(*(range(d) for d in shape)):
    for stop in itertools.product(*(range(a + 1, d + 1) for a, d in zip(start, shape))):
      index = tuple(slice(a, b) for a, b in zip(start, stop))
      run = numbers[index].reshape(-1)
      expected = (int(run[0]), int(run[-1]) + 1) if (np.diff(run) == 1).all() else None
      assert chunk_stream.contiguous_range(index, shape) == expected, index


def test_a_box_that_is_not_one_run_is_refused(saved):
  path, _ = saved
  _, _, stream, _ = _stream(path, "dense")
  try:
    with pytest.raises(ValueError, match="not contiguous"):
      _read(stream, (slice(0, 2), slice(0, 10)))
  finally:
    stream.close()


def test_arrays_in_several_chunks_or_zarr2_are_not_streamed(tmp_path):
  chunked = str(tmp_path / "chunked")
  _save(chunked, chunk_byte_size=64 * 1024)
  store = _open(chunked, "dense")
  assert store.chunk_layout.read_chunk.shape != store.shape
  assert chunk_stream.stored_chunk(store.kvstore, store.spec().to_json()["metadata"], store.shape) is None
  zarr2 = str(tmp_path / "zarr2")
  _save(zarr2, zarr3=False)
  store = _open(zarr2, "dense", zarr3=False)
  assert chunk_stream.stored_chunk(store.kvstore, store.spec().to_json().get("metadata"), store.shape) is None


def test_a_damaged_frame_is_one_line_naming_the_source(tmp_path):
  items = str(tmp_path / "0" / "items")
  _save(items)
  store = _open(items, "dense")
  chunk = chunk_stream.stored_chunk(store.kvstore, store.spec().to_json()["metadata"], store.shape)
  head = bytes(store.kvstore.read(chunk.key, byte_range=slice(chunk.offset, chunk.offset + 64)).result().value)
  data = [os.path.join(root, f) for root, _, files in os.walk(items) for f in files]  # OCDBT's data files
  found = [(path, open(path, "rb").read().find(head)) for path in data]
  path, at = next((path, at) for path, at in found if at >= 0)
  import zstandard  # pylint: disable=import-outside-toplevel

  with open(path, "r+b") as f:  # garble the frame's first block header (a reserved block type): nothing else
    f.seek(at + zstandard.frame_header_size(head))
    f.write(b"\xff" * 3)
  source = read.CheckpointSource.__new__(read.CheckpointSource)  # only what streamed reads use
  source.items_dir, source._names, source._chunks, source._stream, source.decodes = items, {}, {}, None, {}
  source._finishing = []
  source._listing = type("Listing", (), {"use_zarr3": True})()
  store = _open(items, "dense")
  source._names[id(store)] = ("dense",)
  source.open = lambda key: store
  assert source.stream_overhead(store) is not None
  with pytest.raises(errors.CheckpointError) as caught:
    source.read_streamed_async(("dense",), (slice(0, 200), slice(0, 300))).result()
  message = str(caught.value)
  assert items in message and "\n" not in message and "corrupt" in message


def test_an_uncompressed_one_chunk_shard_streams_its_raw_bytes(tmp_path):
  """The same stream over a one-chunk shard whose inner codec is `bytes` alone (no zstd), written by tensorstore."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  values = np.random.default_rng(3).standard_normal((6, 50, 40), np.float32)
  store = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/raw/", "create": True,
                   "metadata": {"shape": list(values.shape), "data_type": "float32",
                                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(values.shape)}},
                                "codecs": [{"name": "sharding_indexed", "configuration": {
                                    "chunk_shape": list(values.shape), "codecs": [{"name": "bytes"}],
                                    "index_codecs": [{"name": "bytes"}, {"name": "crc32c"}]}}]}}).result()
  store.write(values).result()
  chunk = chunk_stream.stored_chunk(store.kvstore, store.spec().to_json()["metadata"], store.shape)
  assert chunk is not None and not chunk.zstd and chunk.nbytes == values.nbytes and chunk.window == 0
  starts = []
  stream = chunk_stream.ChunkStream(store.kvstore, chunk, store.shape, np.float32, lambda: starts.append(1))
  try:
    for i in range(values.shape[0]):
      index = (slice(i, i + 1), slice(0, 50), slice(0, 40))
      assert _read(stream, index).tobytes() == values[index].tobytes()
    assert len(starts) == 1
  finally:
    stream.close()


def test_windows_from_other_stores_are_a_request_s_worth():
  """Windows of 4 MiB from anything but local files (each window of an object store is a request)."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  memory = ts.KvStore.open({"driver": "ocdbt", "base": "memory://"}).result()
  assert chunk_stream.window_bytes(memory) == chunk_stream.WINDOW_BYTES == 4 * 2**20
  assert chunk_stream.window_bytes(ts.KvStore.open("file:///tmp/").result()) == chunk_stream.LOCAL_WINDOW_BYTES
