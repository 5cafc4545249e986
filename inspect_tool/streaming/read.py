"""Reading (export stage 2): the source arrays, slice by slice, from an Orbax checkpoint or the seeded random init.

A checkpoint's arrays are opened through tensorstore (zarr3 or zarr, OCDBT or plain files; files on a local disk
read by mapping them, `storage.mapped_reads`) without a chunk cache, `DECODING_CHUNKS` chunks decoded at once
(`read_context`), and read one chunk-aligned box (`read_plan`) at a time: memory holds the box and the chunks being
decoded into it (`CheckpointSource.read_overhead`), never a whole array. A box whose chunks are too big to sit beside
it is read through a chunk cache of its own (`CheckpointSource.cached_box`): each chunk is decoded once, by the first
slice read from it, and memory holds the decoded chunks and, while decoding, their stored bytes, not the box besides.
Every read is counted (`CheckpointSource.decodes`: chunks and bytes decoded per array).
The random init (no `--checkpoint`) builds the whole model: it is for small models.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool.checkpoint import exports
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.checkpoint import restore
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool.storage import mapped_reads
from inspect_tool.storage import paths
from inspect_tool.streaming import chunk_stream
from inspect_tool.streaming import read_plan
from inspect_tool.streaming import source as source_lib

# Source chunks tensorstore decodes at once (its copy threads). Measured: a box read holds the box and, per chunk
# being decoded, its decoded bytes (its stored bytes are freed before it is copied into the box, whose pages are
# only touched then): reading one 200 MB chunk peaks at 400 MB, a 200 MB box of 20 MB chunks at 237 MB.
DECODING_CHUNKS = 2


# Beside the decoded chunks of a cached box (`CheckpointSource.cached_box`), the cache pool holds the shard index and
# OCDBT's B-tree nodes of the array (kilobytes).
CACHE_MARGIN = 4 * 2**20


def read_context(cache_bytes: int = 0):
  """The tensorstore context of source reads: no chunk cache (every byte read is used once) unless `cache_bytes`
  (then a cache pool of that many bytes, its own), `DECODING_CHUNKS` copy threads and as many file reads in flight
  (no stored chunk waits in memory for a decoder)."""
  return ts.Context({"cache_pool": {"total_bytes_limit": int(cache_bytes)},
                     "data_copy_concurrency": {"limit": DECODING_CHUNKS},
                     "file_io_concurrency": {"limit": DECODING_CHUNKS}})


def nbytes(leaf: tree.Leaf) -> int:
  """Bytes of a leaf's array (shape × dtype)."""
  return leaf.size * np.dtype(leaf.dtype).itemsize


class CheckpointSource(source_lib.ArraySource):
  """The arrays of an Orbax checkpoint for a model's leaves, opened lazily and read by slices."""

  cached_reads = True

  def __init__(self, path: str | locate.ResolvedPath, leaves, context=None):
    self._listing = orbax_metadata.read_listing(path)
    self.items_dir = paths.absolute(self._listing.resolved.items_dir)
    self._pairs = {p.model.key: p for p in restore.plan(self._listing, leaves, report_unused=True)}
    self._context = context or read_context()
    self._base = mapped_reads.kvstore_spec(paths.kvstore_spec(self.items_dir), self.items_dir)
    self._names: dict[int, tuple[str, ...]] = {}  # id(store) -> model leaf key, for counting decodes
    self._stored: dict[tuple[str, ...], int] = {}  # model leaf key -> stored bytes of its largest chunk
    self.decodes: dict[tuple[str, ...], list[int]] = {}  # model leaf key -> [chunks, bytes] decoded so far
    self._counting = threading.Lock()  # streams count their decodes from threads of their own
    self._chunks: dict[tuple[str, ...], Any] = {}  # model leaf key -> its one stored chunk (`stream_overhead`)
    self._stream = None  # (model leaf key, chunk_stream.ChunkStream) of the array streamed last
    self._finishing: list = []  # the streams before it, their last reads running

  def leaf(self, key: tuple[str, ...]) -> tree.Leaf:
    """The checkpoint's leaf (shape, stored dtype) for a model leaf key."""
    return self._pairs[key].checkpoint

  def keys(self):
    return list(self._pairs)

  def open(self, key: tuple[str, ...], cache_bytes: int = 0):
    """The tensorstore handle of the array for model leaf `key` (indexing it is lazy; `np.asarray` reads); with
    `cache_bytes`, through a chunk cache of its own that holds that many decoded bytes (dropped with the handle)."""
    pair = self._pairs[key]
    name = ".".join(str(k) for k in self._listing.raw_keys[pair.checkpoint.key])
    kvstore = {"driver": "ocdbt", "base": self._base} if self._listing.use_ocdbt else self._base
    spec = {"driver": "zarr3" if self._listing.use_zarr3 else "zarr", "kvstore": dict(kvstore, path=name + "/")}
    context = self._context
    if cache_bytes:  # cached chunks are used as they are: the source does not change while it is read
      context, spec = read_context(cache_bytes + CACHE_MARGIN), dict(spec, recheck_cached_data="open")
    try:
      store = ts.open(spec, open=True, read=True, context=context).result()
    except Exception as e:  # pylint: disable=broad-except
      raise errors.CheckpointError(
          f"{self.items_dir}: cannot open the data of {name} ({errors.first_line(e)})") from None
    self._names[id(store)] = key
    return store

  def chunk_shape(self, store) -> tuple[int, ...]:
    """The shape of the source's chunks of `store` (what a read decodes whole)."""
    return tuple(int(d) for d in (store.chunk_layout.read_chunk.shape or store.shape))

  def chunk_bytes(self, store) -> int:
    """Bytes of one decoded source chunk (what reading any part of it holds at once)."""
    return math.prod(self.chunk_shape(store)) * np.dtype(store.dtype.numpy_dtype).itemsize

  def read_overhead(self, store, box) -> int:
    """Bytes held beyond a chunk-aligned box of shape `box` while it is read: the decoded bytes of the chunks
    decoded at once (`DECODING_CHUNKS`, at most as many as the box has)."""
    chunks = read_plan.chunks_touched(tuple(slice(0, int(b)) for b in box), self.chunk_shape(store))
    return min(DECODING_CHUNKS, chunks) * self.chunk_bytes(store)

  def stored_chunk_bytes(self, store) -> int:
    """Stored (encoded) bytes of the largest source chunk of `store`: read from the shard index when the array is
    one zarr3 shard whose index ends it (Orbax's layout), else its decoded bytes."""
    key = self._names.get(id(store), ())
    if key not in self._stored:
      self._stored[key] = chunk_stream.largest_stored_chunk(store.kvstore, self.stored_layout(store), store.shape)
      if self._stored[key] is None:
        self._stored[key] = self.chunk_bytes(store)
    return self._stored[key]

  def cached_overhead(self, store, box) -> int:
    """Bytes held beyond the decoded chunks of a box of shape `box` read through a chunk cache
    (`cached_box`): the stored bytes of the chunks decoded at once (`DECODING_CHUNKS`)."""
    chunks = read_plan.chunks_touched(tuple(slice(0, int(b)) for b in box), self.chunk_shape(store))
    return min(DECODING_CHUNKS, chunks) * self.stored_chunk_bytes(store)

  def stream_overhead(self, store) -> int | None:
    """Bytes a streamed read of `store` holds beside its box (`chunk_stream.StoredChunk.held`), or None when the
    array is not stored as one chunk that can be streamed."""
    key = self._names.get(id(store), ())
    if key not in self._chunks:
      layout = self.stored_layout(store)
      self._chunks[key] = layout and chunk_stream.stored_chunk(store.kvstore, layout, store.shape)
    found = self._chunks[key]
    return found.held if found else None

  def read_streamed_async(self, key: tuple[str, ...], index: tuple[slice, ...]) -> "PendingRead":
    """Starts decoding the box `index` (contiguous in C order) of model leaf `key`'s one-chunk array from its
    stored chunk, front to back (`chunk_stream.ChunkStream`: one stream per array, the earlier ones finishing);
    counted as decoding the chunk each time its decoding starts over."""
    if self._stream is None or self._stream[0] != key:
      if self._stream is not None:  # its reads go on (a read ahead of this array's may overlap them)
        self._stream[1].finish()
        self._finishing.append(self._stream[1])
      self._stream = (key, self.new_stream(key))
    stream = self._stream[1]
    out = aligned_empty([s.stop - s.start for s in index], stream.dtype)
    try:
      future = stream.read_async(index, out)
    except Exception as e:  # pylint: disable=broad-except
      future = e
    return PendingRead(future, self.items_dir, value=out)

  def new_stream(self, key: tuple[str, ...]):
    """A `chunk_stream.ChunkStream` of model leaf `key`'s one-chunk array, of the caller's own (to `close`), each
    start of its decoding counted as decoding the chunk."""
    store = self.open(key)
    if self.stream_overhead(store) is None:
      raise errors.CheckpointError(f"{self.items_dir}: the data of {'/'.join(key)} is not one stored chunk")
    shape = tuple(int(d) for d in store.shape)
    return chunk_stream.ChunkStream(store.kvstore, self._chunks[key], shape, store.dtype.numpy_dtype,
                                    lambda: self._count(store, ()))

  def close_stream(self) -> None:
    """Ends the streams (`read_streamed_async`), waiting for their reads."""
    streams, self._finishing = self._finishing + ([self._stream[1]] if self._stream else []), []
    self._stream = None
    for stream in streams:
      stream.close()

  def cached_box(self, key: tuple[str, ...], index: tuple[slice, ...]) -> "ArrayView":
    """The chunk-aligned box `index` of model leaf `key`'s array as a lazy view, read through a chunk cache of
    its own that holds the box's decoded chunks: the first read of a chunk decodes it, later reads copy from the
    cache (no box-sized buffer beside the decoded chunks). Its chunks are counted here, once; the cache goes
    with the view."""
    store = self.open(key)
    shape, itemsize = tuple(int(d) for d in store.shape), np.dtype(store.dtype.numpy_dtype).itemsize
    store = self.open(key, cache_bytes=read_plan.covered(index, self.chunk_shape(store), shape) * itemsize)
    self._count(store, index)
    return ArrayView(self, store, origin=index)

  def _count(self, store, index: tuple[slice, ...]) -> None:
    shape = tuple(int(d) for d in store.shape)
    index = index or tuple(slice(0, d) for d in shape)
    chunk = self.chunk_shape(store)
    with self._counting:
      counts = self.decodes.setdefault(self._names.get(id(store), ()), [0, 0])
      counts[0] += read_plan.chunks_touched(index, chunk)
      counts[1] += read_plan.covered(index, chunk, shape) * np.dtype(store.dtype.numpy_dtype).itemsize

  def stored_layout(self, store) -> dict | None:
    """The zarr3 metadata of `store` when its stored chunks can be copied as they are (regular grid, default
    chunk keys), else None."""
    if not self._listing.use_zarr3:
      return None
    metadata = store.spec().to_json().get("metadata") or {}
    keys = metadata.get("chunk_key_encoding") or {"name": "default"}
    if (metadata.get("chunk_grid", {}).get("name") != "regular" or keys.get("name") != "default"
        or (keys.get("configuration") or {}).get("separator", "/") != "/"):
      return None
    return metadata

  def read_stored_async(self, store, keys: list[str]) -> "PendingRead":
    """Starts reading the stored (encoded) chunks `keys` of `store`; `.result()` is [(key, bytes)], or None when
    a chunk is not stored (read it decoded instead: it reads as the fill value)."""
    try:
      kvstore = store.kvstore
      future = _StoredChunks(keys, [kvstore.read(key) for key in keys])
    except Exception as e:  # pylint: disable=broad-except
      future = e
    return PendingRead(future, self.items_dir)

  def read(self, store, index: tuple[slice, ...], counted: bool = True) -> np.ndarray:
    """The slice `index` of `store` as a numpy array; a missing or corrupt chunk is one line naming the source."""
    return self.read_async(store, index, counted).result()

  def read_async(self, store, index: tuple[slice, ...], counted: bool = True) -> "PendingRead":
    """Starts reading the slice `index` of `store` in tensorstore's threads; `.result()` is `read`'s. Counted
    as decoding the chunks it touches unless not `counted` (a read from a `cached_box`, counted there).

    The slice is decoded into a 64-byte aligned buffer, which JAX takes without a copy (`aligned`)."""
    out = None
    if counted:
      self._count(store, index)
    try:
      if index:
        part = store[index]
        out = aligned_empty(part.shape, store.dtype.numpy_dtype)
        future = ts.array(out).write(part.translate_to[(0,) * part.rank])
      else:
        future = store.read()
    except Exception as e:  # pylint: disable=broad-except
      future = e
    return PendingRead(future, self.items_dir, value=out)

  def __getitem__(self, key):
    return self.open(key)

  def view(self, key: tuple[str, ...]) -> "ArrayView":
    """The array of model leaf `key` as a lazy array whose indexing reads (and counts) through `read`."""
    return ArrayView(self, self.open(key))

  def decoded(self) -> dict[tuple[str, ...], list[int]]:
    return self.decodes

  def __iter__(self):
    return iter(self._pairs)

  def __len__(self):
    return len(self._pairs)

  def __contains__(self, key):
    return key in self._pairs


class ArrayView(source_lib.View):
  """A source array, or the box `origin` of it (indices relative to the box; reads not counted: `cached_box`),
  that reads the part it is indexed by (slices and integers) through `CheckpointSource.read`."""

  cached_reads = True

  def __init__(self, source: CheckpointSource, store, origin: tuple[slice, ...] | None = None):
    self._source, self._store, self._origin = source, store, origin
    self.shape = tuple(int(d) for d in store.shape) if origin is None else tuple(s.stop - s.start for s in origin)
    self.dtype = np.dtype(store.dtype.numpy_dtype)

  def cached(self, index: tuple[slice, ...]) -> "ArrayView":
    """The chunk-aligned box `index` of this array, read through a chunk cache of its own
    (`CheckpointSource.cached_box`)."""
    return self._source.cached_box(self._source._names[id(self._store)], index)  # pylint: disable=protected-access

  @property
  def stream_overhead(self) -> int | None:
    """What a streamed read of this array holds beside its box (`CheckpointSource.stream_overhead`); None when
    it cannot be streamed."""
    return None if self._origin is not None else self._source.stream_overhead(self._store)

  def stream(self, index: tuple[slice, ...]) -> np.ndarray:
    """The box `index` (one run of the array in C order), decoded from the array's one stored chunk by its stream
    (`CheckpointSource.read_streamed_async`): boxes are best asked for front to back."""
    key = self._source._names[id(self._store)]  # pylint: disable=protected-access
    return self._source.read_streamed_async(key, index).result()

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def __getitem__(self, index) -> np.ndarray:
    index = index if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(self.shape) - len(index))
    box, squeeze = [], []
    for axis, (part, d) in enumerate(zip(index, self.shape)):
      if isinstance(part, slice):
        start, stop, step = part.indices(d)
        if step != 1:
          raise IndexError("ArrayView reads contiguous boxes only")
        box.append(slice(start, stop))
      else:
        i = int(part) + (d if int(part) < 0 else 0)
        box.append(slice(i, i + 1))
        squeeze.append(axis)
    if self._origin is not None:
      box = [slice(o.start + s.start, o.start + s.stop) for o, s in zip(self._origin, box)]
    value = self._source.read(self._store, tuple(box), counted=self._origin is None)
    return value.reshape([n for axis, n in enumerate(value.shape) if axis not in squeeze]) if squeeze else value

  def __array__(self, dtype=None, copy=None):  # pylint: disable=unused-argument
    value = self[()] if self.shape else self._source.read(self._store, (), counted=self._origin is None)
    return np.asarray(value, dtype) if dtype is not None else np.asarray(value)


ALIGNMENT = 64  # what XLA's CPU client needs to use a host buffer as is


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialized C-order array whose data starts on an `ALIGNMENT`-byte boundary."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
  raw = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def compute_device():
  """Where an export's blocks are quantized: JAX's first local device, the accelerator on a TPU (or GPU) host, the
  CPU elsewhere (or under `JAX_PLATFORMS=cpu`)."""
  return jax.local_devices()[0]


def to_jax(value: np.ndarray):
  """`value` as a jax array on `compute_device()`: on the CPU sharing its memory when it is aligned (DLPack), else
  copied there."""
  device = compute_device()
  if (device.platform == "cpu" and value.dtype in (np.float32, np.float64, np.float16)
      and value.flags.c_contiguous and value.flags.writeable and value.ctypes.data % ALIGNMENT == 0):
    return jnp.from_dlpack(value)
  return jax.device_put(value, device)


class _StoredChunks:
  """Reads of stored chunks, as one future."""

  def __init__(self, keys, futures):
    self._keys, self._futures = keys, futures

  def result(self):
    results = [future.result() for future in self._futures]
    if any(r.state != "value" for r in results):
      return None
    return [(key, r.value) for key, r in zip(self._keys, results)]


class PendingRead:
  """A slice being read: `result()` waits for it; a failed read is one line naming the source."""

  def __init__(self, future, items_dir: str, value=None):
    self._future, self._items_dir, self._value = future, items_dir, value

  def result(self) -> np.ndarray:
    if self._future is None:
      return self._value
    try:
      if isinstance(self._future, Exception):
        raise self._future
      done = self._future.result()
      return done if self._value is None else self._value
    except Exception as e:  # pylint: disable=broad-except
      raise errors.CheckpointError(f"{self._items_dir}: cannot read array data: a data file is missing, "
                                   f"truncated or corrupt ({errors.first_line(e)})") from None


class InitSource(source_lib.ArraySource):
  """The seeded random init of the config's model (the whole model is built: for small models)."""

  def __init__(self, cfg, leaves):
    model = model_lib.build_model(cfg, abstract=False)
    values = {params.leaf_key(tuple(map(str, path)), variable): variable.get_value()
              for path, variable in nnx.to_flat_state(nnx.state(model))}
    del model
    self._arrays = {leaf.key: np.asarray(values.pop(leaf.key)) for leaf in leaves}

  def leaf(self, key):
    array = self._arrays[key]
    return tree.Leaf(key, tuple(array.shape), array.dtype.name)

  def keys(self):
    return list(self._arrays)

  def open(self, key):
    return self._arrays[key]

  def chunk_shape(self, store) -> None:  # pylint: disable=unused-argument
    return None  # already in memory

  def stored_layout(self, store) -> None:  # pylint: disable=unused-argument
    return None  # nothing stored

  def chunk_bytes(self, store) -> int:  # pylint: disable=unused-argument
    return 0

  def read_overhead(self, store, box) -> int:  # pylint: disable=unused-argument
    return 0  # nothing decoded

  def read(self, store, index, counted: bool = True):  # pylint: disable=unused-argument
    return store[index] if index else store

  def read_async(self, store, index, counted: bool = True) -> "PendingRead":  # pylint: disable=unused-argument
    return PendingRead(None, "", value=self.read(store, index))

  def __getitem__(self, key):
    return self._arrays[key]

  def __iter__(self):
    return iter(self._arrays)

  def __len__(self):
    return len(self._arrays)

  def __contains__(self, key):
    return key in self._arrays


def check_source(source: str) -> None:
  """Refuses a source that is itself an export (FP8 or int8)."""
  if exports.find_report(source):
    raise errors.InputError(f"source {source!r} is already an {exports.label(source)}; export from the float "
                            "checkpoint")


def open_source(cfg, source: str | locate.ResolvedPath | None, leaves) -> Any:
  """`CheckpointSource` of `source` (a path, or where its caller resolved it to), or `InitSource` of the config's
  seeded init when `source` is None."""
  if source is None:
    return InitSource(cfg, leaves)
  if not isinstance(source, locate.ResolvedPath):
    check_source(source)
  return CheckpointSource(source, leaves)
