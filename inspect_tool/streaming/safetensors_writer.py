"""Streaming safetensors shards: each tensor's bytes go to its shard file as soon as they are computed.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON header (which may end in spaces),
then the tensor data, each tensor's `data_offsets` counted from the end of the header. Every tensor's dtype and
shape are known before its data is, so the writer reserves a fixed header region at the start of each shard
(`header_reserve` bytes, length prefix included), gives each tensor its offsets when it is reserved, and writes
its bytes in order, block by block, at those offsets; once every tensor of a shard is complete the real header,
padded with spaces to the reserved size, goes into the reserved region. Memory holds the block being written,
never a shard. A shard is closed before a tensor would take its data past `max_shard_bytes` (a tensor larger than
that gets a shard of its own) or its header past the reserve.

Shards are written as `.shard-0000k.safetensors.tmp` and renamed to `model-0000k-of-0000n.safetensors` by
`close`, with the permissions `open()` gives a new file. Into a gs:// directory (a staging prefix) each shard's bytes
are streamed into objects as they come and composed into the final name by `close` (`object_shards`): the same
bytes, nothing on local disk.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from typing import Sequence

import ml_dtypes
import numpy as np

from inspect_tool import errors
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths
from inspect_tool.streaming import budget
from inspect_tool.streaming import object_shards

DEFAULT_HEADER_RESERVE = 1 << 20  # about 8000 entries (a 5 GB DeepSeek-V3 shard has under 1000); a multiple of 8
METADATA = {"format": "pt"}
DTYPES = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",  # DeepSeek-V4: e8m0 scales,
          np.dtype(np.int8): "I8", np.dtype(np.int32): "I32"}  # FP4 bytes, tid2eid
_HEAD = json.dumps({"__metadata__": METADATA}, separators=(",", ":"))[:-1]  # '{"__metadata__":{...}' without '}'


def _write_error(path: str, e: OSError) -> errors.InputError:
  return errors.InputError(f"cannot write {path!r}: {e.strerror or e}")


class Region:
  """One tensor's bytes in a shard, filled in order by `write`."""

  def __init__(self, shard: "_Shard", name: str, dtype: np.dtype, begin: int, nbytes: int, digests=None):
    self.shard, self.name, self.dtype = shard, name, dtype
    self.position, self.end = begin, begin + nbytes
    self.digests = digests  # `manifest.digests.Digests` hashing the tensor's bytes as they are written (or None)

  @property
  def complete(self) -> bool:
    return self.position == self.end

  def write(self, block: np.ndarray) -> None:
    """Appends `block` (the tensor's dtype; the next rows in C order) to the tensor's bytes."""
    if block.dtype != self.dtype:
      raise AssertionError(f"{self.name}: block of {block.dtype}, tensor of {self.dtype}")
    data = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
    if self.position + len(data) > self.end:
      raise AssertionError(f"{self.name}: more bytes than its shape holds")
    budget.keep_within()
    self.shard.pwrite(data, self.position)
    if self.digests is not None:
      self.digests.add(self.name, None, block)
    self.position += len(data)
    if self.complete:
      self.shard.region_done()


class _FileSink:
  """A shard's bytes in a local file: data at `header_reserve` + its offset, the header at 0."""

  def __init__(self, path: str, header_reserve: int):
    self.path, self.header_reserve = path, header_reserve
    try:
      self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # open()'s permissions
    except OSError as e:
      raise _write_error(path, e) from None

  def write(self, data: memoryview, position: int) -> None:
    offset = self.header_reserve + position
    try:
      while data:
        written = os.pwrite(self.fd, data, offset)
        data, offset = data[written:], offset + written
    except OSError as e:
      raise _write_error(self.path, e) from None

  def finish(self, header: bytes, size: int) -> None:
    try:
      os.pwrite(self.fd, header, 0)
      os.ftruncate(self.fd, self.header_reserve + size)  # a shard whose last tensor is empty
      os.close(self.fd)
    except OSError as e:
      raise _write_error(self.path, e) from None
    self.fd = None

  def publish(self, final: str) -> None:
    try:
      os.replace(self.path, final)
    except OSError as e:
      raise _write_error(final, e) from None

  def abandon(self) -> None:
    if self.fd is not None:
      os.close(self.fd)
      self.fd = None


class _Shard:
  """One shard being written: its entries, data size and where its bytes go (a local file or objects)."""

  def __init__(self, path: str, header_reserve: int):
    self.path, self.header_reserve = path, header_reserve
    self.entries: list[str] = []  # '"name":{...}' JSON members, in data order
    self.names: list[str] = []
    self.size = 0
    self.header_length = len(_HEAD) + 1
    self.pending = 0  # regions not yet complete
    self.retired = False
    self._lock = threading.Lock()  # regions may be completed by other threads than the one adding them
    self.sink = (object_shards.ObjectSink(path, header_reserve) if paths.is_remote(path)
                 else _FileSink(path, header_reserve))

  def member(self, name: str, dtype: np.dtype, shape: Sequence[int], nbytes: int) -> str:
    entry = {"dtype": DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [self.size,
                                                                                         self.size + nbytes]}
    return json.dumps(name) + ":" + json.dumps(entry, separators=(",", ":"))

  def fits_header(self, member: str) -> bool:
    return 8 + self.header_length + 1 + len(member.encode()) <= self.header_reserve

  def add(self, name: str, dtype: np.dtype, shape: Sequence[int], nbytes: int, digests=None) -> Region:
    member = self.member(name, dtype, shape, nbytes)
    self.entries.append(member)
    self.names.append(name)
    self.header_length += 1 + len(member.encode())
    region = Region(self, name, dtype, self.size, nbytes, digests)
    self.size += nbytes
    with self._lock:
      self.pending += 1
    if region.complete:  # an empty tensor
      self.region_done()
    return region

  def pwrite(self, data: memoryview, position: int) -> None:
    self.sink.write(data, position)

  def region_done(self) -> None:
    with self._lock:
      self.pending -= 1
      done = self.retired and not self.pending
    if done:
      self.finish()

  def retire(self) -> None:
    """No more tensors will be added; the header is written once the last pending tensor is complete."""
    with self._lock:
      self.retired = True
      done = not self.pending
    if done:
      self.finish()

  def finish(self) -> None:
    header = (_HEAD + "".join("," + m for m in self.entries) + "}").encode()
    header += b" " * (self.header_reserve - 8 - len(header))
    self.sink.finish(struct.pack("<Q", len(header)) + header, self.size)

  def abandon(self) -> None:
    self.sink.abandon()


class ShardedWriter:
  """Writes tensors into numbered safetensors shards in `dst_dir`, each tensor's bytes as they come.

  `reserve(name, dtype, shape)` places a tensor (in the current shard, or a new one) and returns its `Region`,
  to be filled by `Region.write` in row order; `add(name, array)` does both for a tensor computed whole. Tensors
  of a shard may be filled in any order, and a shard's regions may still be filled after later shards were
  started; different regions may be filled from different threads (`reserve` and `close` stay in one). Use as a
  context manager: files are closed on failure (the caller removes the directory, after its threads are done).
  `digests` (`manifest.digests.Digests`, hashing in the writing thread) hashes every tensor as it is written.
  """

  def __init__(self, dst_dir: str, max_shard_bytes: int, *, header_reserve: int = DEFAULT_HEADER_RESERVE,
               digests=None):
    if header_reserve % 8 or header_reserve < 64:
      raise ValueError(f"header_reserve {header_reserve} must be a multiple of 8, at least 64")
    self.dst_dir, self.max_shard_bytes, self.header_reserve = dst_dir, max_shard_bytes, header_reserve
    self.digests = digests
    self.shards: list[_Shard] = []
    self.total_size = 0
    self.seen: set[str] = set()
    self.origin = None  # set by the caller: what the tensors reserved from now on come from
    self.origins: dict[str, object] = {}  # tensor name -> `origin` when it was reserved

  def __enter__(self) -> "ShardedWriter":
    return self

  def __exit__(self, *exc) -> None:
    for shard in self.shards:
      shard.abandon()

  def _path(self, k: int) -> str:
    return paths.join(self.dst_dir, f".shard-{k:05d}.safetensors.tmp")

  def _new_shard(self) -> _Shard:
    if self.shards:
      self.shards[-1].retire()
    self.shards.append(_Shard(self._path(len(self.shards) + 1), self.header_reserve))
    return self.shards[-1]

  def reserve(self, name: str, dtype, shape: Sequence[int]) -> Region:
    """Places tensor `name` of `dtype` and `shape`; its bytes are then written through the returned Region."""
    if name in self.seen:
      raise AssertionError(f"tensor {name!r} produced twice")
    self.seen.add(name)
    if self.origin is not None:
      self.origins[name] = self.origin
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    shard = self.shards[-1] if self.shards else self._new_shard()
    if shard.names and (shard.size + nbytes > self.max_shard_bytes
                        or not shard.fits_header(shard.member(name, dtype, shape, nbytes))):
      shard = self._new_shard()
    if not shard.fits_header(shard.member(name, dtype, shape, nbytes)):
      raise ValueError(f"header_reserve {self.header_reserve} cannot hold the header entry of {name!r}")
    self.total_size += nbytes
    if self.digests is not None:
      self.digests.track(name, shape, dtype)
    return shard.add(name, dtype, shape, nbytes, self.digests)

  def add(self, name: str, array: np.ndarray) -> None:
    """Writes a tensor computed whole."""
    self.reserve(name, array.dtype, array.shape).write(array)

  def close(self) -> dict[str, str]:
    """Completes every shard, gives each its final name and returns the weight map (tensor -> file name)."""
    if not self.shards:
      self._new_shard()
    self.shards[-1].retire()
    unfinished = [s.path for s in self.shards if s.pending]
    if unfinished:
      raise AssertionError(f"{unfinished[0]}: tensors not completely written")
    n = len(self.shards)
    weight_map = {}
    for k, shard in enumerate(self.shards, start=1):
      final = paths.join(self.dst_dir, f"model-{k:05d}-of-{n:05d}.safetensors")
      shard.sink.publish(final)
      weight_map.update({name: paths.basename(final) for name in shard.names})
    return dict(sorted(weight_map.items(), key=lambda item: tree.natural_key(item[0])))
