"""Export stage 2, reading: the source arrays, slice by slice, from an Orbax checkpoint or the seeded random init.

A checkpoint's arrays are opened through tensorstore (zarr3 or zarr, OCDBT or plain files), without a chunk cache,
and read one slice (`budget.Slicing`) at a time: memory holds the slice and the source chunks it touches, never a
whole array. The random init (no `--checkpoint`) builds the whole model: it is for small models.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from inspect_tool import errors
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths


def nbytes(leaf: tree.Leaf) -> int:
  """Bytes of a leaf's array (shape × dtype)."""
  return leaf.size * np.dtype(leaf.dtype).itemsize


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return (lines[0] if lines else type(e).__name__)[:300]


class CheckpointSource:
  """The arrays of an Orbax checkpoint for a model's leaves, opened lazily and read by slices."""

  def __init__(self, path: str, leaves, context=None):
    from inspect_tool.checkpoint import orbax_metadata, restore  # pylint: disable=import-outside-toplevel
    from inspect_tool.fp8_export import orbax_writer  # pylint: disable=import-outside-toplevel

    self._listing = orbax_metadata.read_listing(path)
    self.items_dir = paths.absolute(self._listing.resolved.items_dir)
    self._pairs = {p.model.key: p for p in restore.plan(self._listing, leaves, report_unused=True)}
    self._context = context or orbax_writer.ts_context()

  def leaf(self, key: tuple[str, ...]) -> tree.Leaf:
    """The checkpoint's leaf (shape, stored dtype) for a model leaf key."""
    return self._pairs[key].checkpoint

  def keys(self):
    return list(self._pairs)

  def open(self, key: tuple[str, ...]):
    """The tensorstore handle of the array for model leaf `key` (indexing it is lazy; `np.asarray` reads)."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    pair = self._pairs[key]
    name = ".".join(str(k) for k in self._listing.raw_keys[pair.checkpoint.key])
    base = paths.kvstore_spec(self.items_dir)
    kvstore = {"driver": "ocdbt", "base": base} if self._listing.use_ocdbt else base
    spec = {"driver": "zarr3" if self._listing.use_zarr3 else "zarr", "kvstore": dict(kvstore, path=name + "/")}
    try:
      return ts.open(spec, open=True, read=True, context=self._context).result()
    except Exception as e:  # pylint: disable=broad-except
      raise errors.CheckpointError(f"{self.items_dir}: cannot open the data of {name} ({_first_line(e)})") from None

  def chunk_shape(self, store) -> tuple[int, ...]:
    """The shape of the source's chunks of `store` (what a read decodes whole)."""
    return tuple(int(d) for d in (store.chunk_layout.read_chunk.shape or store.shape))

  def chunk_bytes(self, store) -> int:
    """Bytes of one decoded source chunk (what reading any part of it holds at once)."""
    return math.prod(self.chunk_shape(store)) * np.dtype(store.dtype.numpy_dtype).itemsize

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

  def read(self, store, index: tuple[slice, ...]) -> np.ndarray:
    """The slice `index` of `store` as a numpy array; a missing or corrupt chunk is one line naming the source."""
    return self.read_async(store, index).result()

  def read_async(self, store, index: tuple[slice, ...]) -> "PendingRead":
    """Starts reading the slice `index` of `store` in tensorstore's threads; `.result()` is `read`'s.

    The slice is decoded into a 64-byte aligned buffer, which JAX takes without a copy (`aligned`)."""
    import tensorstore as ts  # pylint: disable=import-outside-toplevel

    out = None
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

  def __iter__(self):
    return iter(self._pairs)

  def __len__(self):
    return len(self._pairs)

  def __contains__(self, key):
    return key in self._pairs


ALIGNMENT = 64  # what XLA's CPU client needs to use a host buffer as is


def aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialized C-order array whose data starts on an `ALIGNMENT`-byte boundary."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
  raw = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def to_jax(value: np.ndarray):
  """`value` as a jax array on the CPU, sharing its memory when it is aligned (DLPack), else copied."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  if (value.dtype in (np.float32, np.float64, np.float16) and value.flags.c_contiguous and value.flags.writeable
      and value.ctypes.data % ALIGNMENT == 0):
    return jnp.from_dlpack(value)
  return jnp.asarray(value)


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
                                   f"truncated or corrupt ({_first_line(e)})") from None


class InitSource:
  """The seeded random init of the config's model (the whole model is built: for small models)."""

  def __init__(self, cfg, leaves):
    from flax import nnx  # pylint: disable=import-outside-toplevel

    from inspect_tool import model as model_lib  # pylint: disable=import-outside-toplevel
    from inspect_tool.paramtree import params  # pylint: disable=import-outside-toplevel

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

  def read(self, store, index):
    return store[index] if index else store

  def read_async(self, store, index) -> "PendingRead":
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
  """Refuses a source that is itself an FP8 export."""
  from inspect_tool.fp8_export import load  # pylint: disable=import-outside-toplevel

  if load.find_report(source):
    raise errors.InputError(f"source {source!r} is already an FP8 export; export from the float checkpoint")


def open_source(cfg, source: str | None, leaves) -> Any:
  """`CheckpointSource` of `source`, or `InitSource` of the config's seeded init when `source` is None."""
  if source is None:
    return InitSource(cfg, leaves)
  check_source(source)
  return CheckpointSource(source, leaves)
