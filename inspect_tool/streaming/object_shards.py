"""A safetensors shard written straight to gs://: its bytes streamed into objects as they come, composed at the end.

Object stores have no writes at an offset, and a shard's tensors are filled in any order (two converters at once,
an embedding and its MTP copy row block by row block), its header last. So `ObjectSink` streams the data into
*segments*: a write at the end of a segment that is not being written to appends to it, any other write opens a
new segment object (`<shard>.part-<data offset>`), each one resumable upload (`storage.objects.open_write`: at most
`BLOCK_BYTES` held per segment; when it closes, the MD5 the store computed of what it keeps is checked against that
of what was sent). A
segment is closed as soon as the bytes after its end begin another segment, and all of them when the shard is
complete; the header (its reserved size, space-padded as on a local disk) is an object of its own. `publish(url)`
composes header and segments in offset order into the final shard (GCS `compose`, server side) and removes the
parts: the same bytes as the local file, never a whole shard on local disk or in memory.
"""

from __future__ import annotations

import base64
import hashlib
import threading

from inspect_tool import errors
from inspect_tool.storage import objects

BLOCK_BYTES = 4 * 2**20  # what one segment holds in memory before it sends it (a multiple of 256 KiB)
# What the open segments hold, counted in --max-memory: up to two blocks each (the buffer and the piece being added),
# and at most four open at once (two converters, an embedding and its MTP copy filled block by block).
RESERVE_BYTES = 4 * 2 * BLOCK_BYTES


def _failure(url: str, e: BaseException) -> errors.InputError:
  text = "stored with other bytes than were sent (MD5 differs)" if "checksum" in str(e).lower() else \
      errors.first_line(e)[:300]
  return errors.InputError(f"cannot write {url!r}: {text}")


class _Segment:
  """One part object: the data bytes [start, end) of the shard, `stream` open while it may grow; once closed, the
  MD5 the store computed of what it keeps must be that of what was sent."""

  def __init__(self, url: str, start: int):
    self.url, self.start, self.end, self.busy = url, start, start, False
    self.stream = objects.open_write(url, BLOCK_BYTES)
    self.md5 = hashlib.md5()

  def write(self, data) -> None:
    self.md5.update(data)
    self.stream.write(data)

  def close(self) -> None:
    stream, self.stream = self.stream, None
    if stream is not None:
      stream.close()
      stored = objects.filesystem().info(self.url[len("gs://"):]).get("md5Hash")
      if stored != base64.b64encode(self.md5.digest()).decode():
        raise ValueError("checksum: the store's MD5 differs")


def _checked_upload(url: str, data: bytes) -> None:
  """The object `url` of `data`, its stored MD5 checked."""
  segment = _Segment(url, 0)
  segment.write(data)
  segment.close()


class ObjectSink:
  """The bytes of one shard, `url` its temporary name (the parts are named after it)."""

  def __init__(self, url: str, header_reserve: int):
    self.url, self.header_reserve = url, header_reserve
    self._segments: list[_Segment] = []
    self._starts: set[int] = set()
    self._lock = threading.Lock()
    self._header = None  # the header object's URL once written

  def write(self, data: memoryview, position: int) -> None:
    """`data` at data offset `position` (after the header); called from any thread, each byte once."""
    if not len(data):
      return
    with self._lock:
      segment = next((s for s in self._segments if s.stream is not None and not s.busy and s.end == position), None)
      if segment is None:
        try:
          segment = _Segment(f"{self.url}.part-{position:016d}", position)
        except Exception as e:  # pylint: disable=broad-except
          raise _failure(self.url, e) from None
        self._segments.append(segment)
        self._starts.add(position)
        for other in self._segments:  # a segment ending where this one starts can no longer grow
          if other is not segment and other.end == position and not other.busy:
            self._close(other)
      segment.busy = True
    try:
      for begin in range(0, len(data), BLOCK_BYTES):  # never a second copy of a large write in the buffer
        segment.write(data[begin:begin + BLOCK_BYTES])
    except Exception as e:  # pylint: disable=broad-except
      raise _failure(self.url, e) from None
    finally:
      with self._lock:
        segment.busy = False
        segment.end = position + len(data)
    with self._lock:
      if segment.end in self._starts:
        self._close(segment)

  def _close(self, segment: _Segment) -> None:
    try:
      segment.close()
    except Exception as e:  # pylint: disable=broad-except
      raise _failure(self.url, e) from None

  def finish(self, header: bytes, size: int) -> None:
    """The shard is complete: `header` (the reserved region, length prefix included) written, every segment
    closed; `size` is its data's length, which the segments must cover exactly."""
    with self._lock:
      for segment in self._segments:
        self._close(segment)
      covered = sum(s.end - s.start for s in self._segments)
      if covered != size:
        raise AssertionError(f"{self.url}: {covered} of {size} data bytes written")
      try:
        _checked_upload(f"{self.url}.header", header)
      except Exception as e:  # pylint: disable=broad-except
        raise _failure(self.url, e) from None
      self._header = f"{self.url}.header"

  def publish(self, url: str) -> None:
    """Composes the finished shard as the object `url` and removes its parts."""
    parts = [self._header] + [s.url for s in sorted(self._segments, key=lambda s: s.start)]
    try:
      objects.compose(url, parts)
      objects.filesystem().rm([p[len("gs://"):] for p in parts])
    except Exception as e:  # pylint: disable=broad-except
      raise _failure(url, e) from None

  def abandon(self) -> None:
    """Cancels the uploads still open, sending nothing more (the staging prefix is removed by the caller)."""
    for segment in self._segments:
      stream, segment.stream = segment.stream, None
      if stream is not None:
        try:
          stream.discard()
        except Exception:  # pylint: disable=broad-except
          pass
        stream.closed = True  # not completed when collected
