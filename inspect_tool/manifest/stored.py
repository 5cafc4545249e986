"""The stored tensors of an export, read back in bounded memory: names, shapes, dtypes and a sha256 of each.

A tensor's sha256 is that of its elements in C order, each as stored (little-endian; float8 one byte, bfloat16
two): for safetensors exactly the tensor's bytes in its shard (read by byte ranges, gs:// included), for an Orbax
checkpoint (`DST/0/items`, OCDBT + zarr3) its decoded array read in C-order slabs of at most `piece_bytes`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Callable, Iterator

import ml_dtypes
import numpy as np
import tensorstore as ts

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.hf import tensors as hf_tensors
from inspect_tool.hf import safetensors_header
from inspect_tool.storage import paths
from inspect_tool.storage import remote

ORBAX, SAFETENSORS = "orbax", "safetensors"
SAFETENSORS_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "BF16": ml_dtypes.bfloat16,
                      "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32,
                      "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I8": np.int8}  # DeepSeek-V4: e8m0 scales, FP4 bytes


def format_of(path: str) -> str:
  """`ORBAX` when `path` holds `0/items` (an Orbax export), else `SAFETENSORS`."""
  return ORBAX if files.kind(paths.join(path, "0", "items", "_METADATA")) == "file" else SAFETENSORS


class StoredTensors:
  """The tensors of the export at `path` (its format: `format_of`)."""

  def __init__(self, path: str):
    self.path, self.format = path, format_of(path)
    self._tensors: dict[str, tuple] = {}  # name -> (shape, dtype, reader handle)
    if self.format == ORBAX:
      self._open_orbax()
    else:
      for name, (file, entry) in safetensors_header.read_tensor_table(path).items():
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
          raise errors.CheckpointError(f"{file}: tensor {name!r} has dtype {entry['dtype']}, which exports do not "
                                       f"write; accepted: {', '.join(SAFETENSORS_DTYPES)}")
        self._tensors[name] = (tuple(entry["shape"]), np.dtype(dtype), (file, entry["start"]))

  def _open_orbax(self) -> None:
    base = paths.kvstore_spec(paths.join(self.path, "0", "items"))
    context = remote.context() if paths.is_remote(self.path) else ts.Context()
    try:
      kv = ts.KvStore.open({"driver": "ocdbt", "base": base}, context=context).result()
      names = sorted({k.decode().rsplit("/zarr.json", 1)[0] for k in kv.list().result() if k.endswith(b"/zarr.json")})
      opened = [ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": n + "/"}},
                        open=True, context=context) for n in names]
      for name, future in zip(names, opened):
        store = future.result()
        self._tensors[name] = (tuple(int(d) for d in store.shape), np.dtype(store.dtype.numpy_dtype), store)
    except (ValueError, RuntimeError, OSError) as e:
      raise errors.CheckpointError(f"{self.path}: cannot read the Orbax arrays under 0/items: {str(e)[:300]}") from None

  def names(self) -> list[str]:
    return list(self._tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._tensors[name][0]

  def dtype(self, name: str) -> np.dtype:
    return self._tensors[name][1]

  def nbytes(self, name: str) -> int:
    return math.prod(self.shape(name)) * self.dtype(name).itemsize

  def pieces(self, name: str, piece_bytes: int, into: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """The elements of `name` in C order, flat, in pieces of at most `piece_bytes` (at least one element); `into`:
    a byte buffer of at least `piece_bytes` that an Orbax tensor's pieces are read into, each valid until the next
    (the same pages every piece, not fresh ones)."""
    shape, dtype, handle = self._tensors[name]
    if self.format == SAFETENSORS:
      yield from _file_pieces(handle, name, math.prod(shape), dtype, piece_bytes)
    else:
      yield from _array_pieces(handle, name, self.path, shape, dtype, piece_bytes, into)

  def digest(self, name: str, piece_bytes: int, on_values: Callable[[np.ndarray], None] | None = None,
             into: np.ndarray | None = None) -> str:
    """The sha256 (hex) of `name`'s elements as stored; `on_values(piece)` sees every piece on the way; `into`: as
    for `pieces`."""
    sha = hashlib.sha256()
    for piece in self.pieces(name, piece_bytes, into):
      sha.update(np.ascontiguousarray(piece).view(np.uint8))
      if on_values is not None:
        on_values(piece)
    return sha.hexdigest()


def _file_pieces(handle, name: str, count: int, dtype: np.dtype, piece_bytes: int) -> Iterator[np.ndarray]:
  file, start = handle
  step = max(1, piece_bytes // dtype.itemsize)
  for first in range(0, count, step):
    n = min(step, count - first)
    data = hf_tensors.read_span(file, name, start + first * dtype.itemsize, n * dtype.itemsize)
    if len(data) != n * dtype.itemsize:
      raise errors.CheckpointError(f"{file}: tensor {name!r} is truncated")
    yield np.frombuffer(data, dtype)


def slabs(shape: tuple[int, ...], itemsize: int, piece_bytes: int) -> Iterator[tuple[slice, ...]]:
  """Boxes of `shape` in C order, each contiguous in C order and of at most `piece_bytes` (at least one element)."""
  if not shape:
    yield ()
    return
  axis = next((a for a in range(len(shape)) if math.prod(shape[a + 1:]) * itemsize <= piece_bytes), len(shape) - 1)
  inner = math.prod(shape[axis + 1:]) * itemsize
  count = max(1, piece_bytes // inner) if inner else shape[axis]
  for lead in itertools.product(*(range(d) for d in shape[:axis])):
    for begin in range(0, shape[axis], count):
      yield (tuple(slice(i, i + 1) for i in lead) + (slice(begin, min(begin + count, shape[axis])),)
             + tuple(slice(0, d) for d in shape[axis + 1:]))


def _array_pieces(store, name: str, path: str, shape, dtype: np.dtype, piece_bytes: int,
                  into: np.ndarray | None) -> Iterator[np.ndarray]:
  if math.prod(shape) == 0:
    return
  for box in slabs(shape, dtype.itemsize, piece_bytes):
    view = store[box]
    try:
      if into is None:
        value = view.read().result()
      else:  # tensorstore writes the piece into the buffer's first bytes
        value = into[:math.prod(view.shape) * dtype.itemsize].view(dtype).reshape(view.shape)
        ts.array(value, copy=False, write=True).write(view).result()
    except (ValueError, RuntimeError, OSError) as e:
      raise errors.CheckpointError(f"{path}: cannot read array {name}: {str(e)[:300]}") from None
    yield np.asarray(value).reshape(-1)
