"""Streamed reads of a source array stored as one zarr3 chunk (Orbax's layout for every array under its chunk cap):
the chunk's stored bytes are read in windows and decoded front to back, straight into the boxes asked for, so a
read holds its box and a few windows, never the whole decoded chunk beside its stored bytes.

Boxes must be contiguous in C order (`contiguous_range`) and are best asked for front to back: a box behind the
point reached starts the chunk's decoding over (counted as another decode of the chunk).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import mmap
import os
from typing import Callable, Sequence

import numpy as np
import zstandard

from inspect_tool.storage import mapped_reads
from inspect_tool.storage import value_files

# Stored bytes read at once (one more is read ahead while these are decoded). From an object store each window is
# a request. From local files read through tensorstore, windows stay under a quarter of the allocator's trim
# threshold (`budget.FREED_MEMORY_THRESHOLD`): its Python binding copies each window twice (into a string, then
# bytes), and buffers that small are reused from the heap instead of being mapped, zeroed and unmapped each time.
# A chunk whose data file is on a local disk (`storage.value_files`, `storage.mapped_reads`) is instead mapped by
# the stream itself, `MAPPED_WINDOW_BYTES` at a time: no copy, no request per window (a window costs two system
# calls, and memory holds the pages of two).
WINDOW_BYTES = 4 * 2**20
LOCAL_WINDOW_BYTES = 256 * 2**10
MAPPED_WINDOW_BYTES = 2**20
HEAD_BYTES = 32  # the frame's first bytes, read through tensorstore (the decoder's window; the mapped file's check)
DECODER_BYTES = 2**18  # a zstd decoder's buffers beside its window (a block in and out, 128 KiB each)
_MISSING = 2**64 - 1  # shard index offset of a chunk that is not stored


@dataclasses.dataclass(frozen=True)
class StoredChunk:
  """Where an array's only chunk lies in its shard (`key` of the kvstore, byte `offset`, `nbytes`) and how it is
  encoded: zstd-compressed (`window`: the decoder's window, from the frame header) or raw little-endian bytes."""

  key: str
  offset: int
  nbytes: int
  zstd: bool
  window: int = 0
  read_bytes: int = WINDOW_BYTES  # stored bytes read at once
  file: str | None = None  # the local data file that holds the chunk, mapped by the stream (None: read by key)
  file_offset: int = 0  # where the chunk starts in `file`

  @property
  def held(self) -> int:
    """Bytes a stream holds beside the box it decodes into: two windows of stored bytes (the one being decoded,
    the next being read), the decoder's window and its buffers."""
    return 2 * min(self.read_bytes, self.nbytes) + self.window + DECODER_BYTES


def _shard_index(kvstore, metadata: dict | None, shape: Sequence[int]):
  """(chunk key, [(offset, nbytes)] of its inner chunks, inner codec names) of a zarr3 array that is a single
  `sharding_indexed` shard whose index (little-endian, optionally crc32c) ends it; None for any other layout."""
  codecs = (metadata or {}).get("codecs") or []
  if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed" or not shape:
    return None
  conf = codecs[0].get("configuration") or {}
  shard = (metadata.get("chunk_grid") or {}).get("configuration", {}).get("chunk_shape") or []
  inner = conf.get("chunk_shape") or []
  index_codecs = [(c.get("name"), (c.get("configuration") or {}).get("endian", "little"))
                  for c in conf.get("index_codecs") or []]
  if (conf.get("index_location", "end") != "end" or len(shard) != len(shape) or len(inner) != len(shape)
      or any(int(s) < int(d) for d, s in zip(shape, shard))
      or index_codecs not in ([("bytes", "little")], [("bytes", "little"), ("crc32c", "little")])):
    return None
  count = math.prod(-(-int(s) // int(c)) for s, c in zip(shard, inner))
  size = 16 * count + 4 * (len(index_codecs) == 2)
  key = "c" + "/0" * len(shape)
  try:
    found = kvstore.read(key, byte_range=slice(-size, None)).result()
  except Exception:  # pylint: disable=broad-except
    return None
  if found.state != "value" or len(found.value) != size:
    return None
  pairs = [(int(o), int(n)) for o, n in np.frombuffer(bytes(found.value)[:16 * count], "<u8").reshape(count, 2)]
  names = [(c.get("name"), (c.get("configuration") or {}).get("endian", "little")) for c in conf.get("codecs") or []]
  return key, pairs, names


def largest_stored_chunk(kvstore, metadata: dict | None, shape: Sequence[int]) -> int | None:
  """Stored bytes of the largest inner chunk of an array that is one shard (`_shard_index`); None for others."""
  found = _shard_index(kvstore, metadata, shape)
  if found is None:
    return None
  return max((n for offset, n in found[1] if offset != _MISSING), default=0)


def window_bytes(kvstore) -> int:
  """Stored bytes read at once from `kvstore` (an OCDBT database's: from its base): `LOCAL_WINDOW_BYTES` from
  local files, else `WINDOW_BYTES`."""
  base = kvstore.base if kvstore.base is not None else kvstore
  return LOCAL_WINDOW_BYTES if base.spec().to_json().get("driver") == "file" else WINDOW_BYTES


def stored_chunk(kvstore, metadata: dict | None, shape: Sequence[int]) -> StoredChunk | None:
  """The one stored chunk of an array that is one shard (`_shard_index`) holding one inner chunk, encoded
  `bytes` (little-endian) then optionally `zstd`, read `window_bytes(kvstore)` at a time; None for any other
  layout, or when the chunk is not stored (it reads as the fill value)."""
  found = _shard_index(kvstore, metadata, shape)
  if found is None:
    return None
  key, pairs, names = found
  if len(pairs) != 1 or pairs[0][0] == _MISSING or not names or names[0] != ("bytes", "little") or names[1:] not in (
      [], [("zstd", "little")]):
    return None
  (offset, nbytes), zstd, window = pairs[0], len(names) == 2, 0
  try:
    head = bytes(kvstore.read(key, byte_range=slice(offset, offset + min(nbytes, HEAD_BYTES))).result().value)
    if zstd:
      window = int(zstandard.get_frame_parameters(head).window_size)
  except Exception:  # pylint: disable=broad-except
    return None
  mapped = _mapped_file(kvstore, key, offset, nbytes, head)
  if mapped is not None:
    return StoredChunk(key, offset, nbytes, zstd, window, MAPPED_WINDOW_BYTES, *mapped)
  return StoredChunk(key, offset, nbytes, zstd, window, window_bytes(kvstore))


def _mapped_file(kvstore, key: str, offset: int, nbytes: int, head: bytes) -> tuple[str, int] | None:
  """(local data file, offset in it) of the stored chunk at `offset` of `key`'s value, when the file may be mapped
  (`storage.mapped_reads`), holds the whole chunk and starts it with `head` (what tensorstore read there)."""
  found = value_files.locate(kvstore, key)
  if found is None or offset + nbytes > found.nbytes or not mapped_reads.allowed(found.path):
    return None
  at = found.offset + offset
  try:
    with open(found.path, "rb") as f:
      if os.fstat(f.fileno()).st_size < at + nbytes:
        return None
      f.seek(at)
      if f.read(len(head)) != head:
        return None
  except OSError:
    return None
  return found.path, at


def contiguous_range(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[int, int] | None:
  """The [start, stop) element range of the box `index` in the C order of an array of `shape`, when the box is
  one run of it (sides of 1 before its one partial axis, whole axes after); else None."""
  sides = [s.stop - s.start for s in index]
  partial = [axis for axis, (n, d) in enumerate(zip(sides, shape)) if n != d]
  if partial and any(n != 1 for n in sides[:partial[-1]]):
    return None
  start = int(np.ravel_multi_index([s.start for s in index], shape)) if index and math.prod(shape) else 0
  return start, start + math.prod(sides)


class _Windows:
  """A file-like reader of the chunk's stored bytes, window by window, the next window read in the background."""

  def __init__(self, kvstore, chunk: StoredChunk):
    self._kvstore, self._chunk, self._pos, self._pending = kvstore, chunk, 0, None
    self._buffer = b""

  def _fetch(self, pos: int):
    stop = min(pos + self._chunk.read_bytes, self._chunk.nbytes)
    if pos >= stop:
      return None
    return self._kvstore.read(self._chunk.key, byte_range=slice(self._chunk.offset + pos, self._chunk.offset + stop))

  def close(self) -> None:
    self._buffer, self._pending = b"", None

  def read(self, size: int = -1) -> bytes:
    if not self._buffer:
      pending = self._pending if self._pending is not None else self._fetch(self._pos)
      if pending is None:
        return b""
      found = pending.result()
      if found.state != "value":
        raise OSError(f"the stored chunk {self._chunk.key} is missing")
      self._buffer = bytes(found.value)
      if not self._buffer:
        raise OSError(f"the stored chunk {self._chunk.key} is truncated")
      self._pos += len(self._buffer)
      self._pending = self._fetch(self._pos)
    if size is None or size < 0 or size >= len(self._buffer):
      out, self._buffer = self._buffer, b""
    else:
      out, self._buffer = self._buffer[:size], self._buffer[size:]
    return out


class _MappedWindows:
  """The chunk's stored bytes from its local data file, mapped `read_bytes` at a time: each window is a view of the
  page cache's pages, unmapped once the decoder lets go of it (no copy, no request)."""

  def __init__(self, chunk: StoredChunk):
    self._chunk, self._pos = chunk, 0
    self._fd = os.open(chunk.file, os.O_RDONLY)

  def read(self, size: int = -1) -> memoryview | bytes:
    left = self._chunk.nbytes - self._pos
    n = min(left, self._chunk.read_bytes if size is None or size < 0 else size, self._chunk.read_bytes)
    if n <= 0:
      return b""
    start = self._chunk.file_offset + self._pos
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    window = mmap.mmap(self._fd, start + n - aligned, access=mmap.ACCESS_READ, offset=aligned)
    if hasattr(window, "madvise"):
      window.madvise(mmap.MADV_WILLNEED)  # read from disk ahead of the decoder when not cached
    self._pos += n
    return memoryview(window)[start - aligned:]

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1


class ChunkStream:
  """Serves contiguous boxes of one array from its stored chunk, decoded front to back in a thread of its own
  (reads run one after another, in the order they were asked for). `on_decode()` is called each time the chunk's
  decoding starts (the first read, and every read behind the point reached)."""

  def __init__(self, kvstore, chunk: StoredChunk, shape: Sequence[int], dtype, on_decode: Callable[[], None]):
    self._kvstore, self._chunk = kvstore, chunk
    self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
    self._on_decode = on_decode
    self._reader, self._at = None, 0  # the decoder, and the element it has reached
    self._source = None  # the windows of stored bytes the decoder reads
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chunk-stream")  # its only reader

  def read_async(self, index: tuple[slice, ...], out: np.ndarray) -> concurrent.futures.Future:
    """Starts decoding the box `index` into `out` (C-contiguous, the box's shape and dtype); `.result()` is
    `out`. Raises ValueError when the box is not one run of the array (`contiguous_range`)."""
    span = contiguous_range(index, self.shape)
    if span is None:
      raise ValueError(f"box {index} of an array of shape {self.shape} is not contiguous")
    return self._pool.submit(self._read, span, out)

  def _start(self):
    self._end()
    source = _MappedWindows(self._chunk) if self._chunk.file else _Windows(self._kvstore, self._chunk)
    self._source = source
    if self._chunk.zstd:
      decompressor = zstandard.ZstdDecompressor()
      self._reader = decompressor.stream_reader(source, read_size=self._chunk.read_bytes, closefd=False)
    else:
      self._reader = source
    self._at = 0
    self._on_decode()

  def _fill(self, view: memoryview) -> None:
    done = 0
    while done < len(view):
      if self._chunk.zstd:
        n = self._reader.readinto(view[done:])
      else:
        piece = self._reader.read(len(view) - done)
        n = len(piece)
        view[done:done + n] = piece
      if not n:
        raise OSError(f"the stored chunk {self._chunk.key} ends early")
      done += n

  def _read(self, span: tuple[int, int], out: np.ndarray) -> np.ndarray:
    start, stop = span
    if self._reader is None or start < self._at:
      self._start()
    skip = (start - self._at) * self.dtype.itemsize
    scratch = np.empty(min(skip, self._chunk.read_bytes), np.uint8) if skip else None
    while skip:
      part = memoryview(scratch)[:min(skip, len(scratch))]
      self._fill(part)
      skip -= len(part)
    self._fill(memoryview(out.reshape(-1).view(np.uint8)))
    self._at = stop
    if stop == math.prod(self.shape):  # the end of the chunk: its decoder's buffers are not needed again
      self._end()
    return out

  def _end(self) -> None:
    if self._reader is not None:
      self._reader.close()
      self._reader = None
    if self._source is not None:
      self._source.close()
      self._source = None

  def finish(self) -> None:
    """Lets the reads asked for run to their end in the background, then ends the stream (no more reads)."""
    self._pool.submit(self._end)
    self._pool.shutdown(wait=False)

  def close(self) -> None:
    """Waits for the reads asked for, then ends the stream."""
    self._pool.shutdown(wait=True)
    self._end()
