"""The boxes of an export read in order, the next one read in the background while one is processed when the
budget holds it (`write_orbax.ArrayJob.ahead`, `read_bytes`): within an array, and across arrays."""

from __future__ import annotations

import itertools
from typing import Sequence


def chunk_keys(index: tuple[slice, ...], chunk: Sequence[int]) -> list[str]:
  """The zarr3 keys (default encoding) of the chunks that the block `index` covers."""
  ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(index, chunk)]
  return ["c" + "".join(f"/{i}" for i in grid) for grid in itertools.product(*ranges)]


class _Ready:
  """A read that needs no reading: the slice is still in memory (None), or a cached box's view (`value`)."""

  def __init__(self, value=None):
    self._value = value

  def result(self):
    return self._value


class BoxReads:
  """The boxes to read, in order; the next box is read in the background while one is processed when the job
  being processed reads ahead (`ArrayJob.ahead`: the budget holds two of its boxes) and the next box is its own,
  or the next array's whose read holds no more than one of its boxes (`_may_follow`); else only when it is taken.

  `work` holds (job, index, kind) items; a `REUSE` item reads nothing (its value is the last one taken).
  """

  def __init__(self, source, work: list[tuple]):
    self._source, self._work, self._next = source, work, 0
    self._key = self._store = None  # the source array being read
    self._pending = self._start(0)

  def _start(self, i: int):
    if i >= len(self._work):
      return None
    job, index, kind = self._work[i]
    if kind == REUSE:
      return _Ready()
    if job.cached:  # a view whose slices decode the box's chunks once, into a cache of its own
      return _Ready(self._source.cached_box(job.leaf.key, index))
    if job.leaf.key != self._key:
      self._key, self._store = job.leaf.key, self._source.open(job.leaf.key)
    if job.stored is not None:
      return self._source.read_stored_async(self._store, chunk_keys(index, job.chunk))
    return self._source.read_async(self._store, index)

  def read_again(self, index: tuple[slice, ...]):
    """The decoded values of a slice of the array being read (a slice whose chunks are not all stored)."""
    return self._source.read(self._store, index)

  def take(self):
    """The next box's values (the caller holds no other box); starts reading the one after it when allowed."""
    if self._pending is None:
      self._pending = self._start(self._next)
    pending, job, self._next = self._pending, self._work[self._next][0], self._next + 1
    self._pending = None
    value = pending.result()
    if job.ahead and self._next < len(self._work) and _may_follow(job, self._work[self._next][0]):
      self._pending = self._start(self._next)
    return value

  def close(self) -> None:
    """Waits for the read in flight, ignoring its outcome."""
    pending, self._pending = self._pending, None
    try:
      if pending is not None:
        pending.result()
    except Exception:  # pylint: disable=broad-except
      pass


def _may_follow(job, following) -> bool:
  """Whether `following`'s next box may be read while `job` (which reads ahead) is processed: its own next box, or
  the next array's first when that read holds no more than one box of `job` does (so the two-box budget of `job`
  covers it), is not cached, and `job` does not read its source again (a copy of stored chunks)."""
  if following is job:
    return True
  return (job.stored is None and not following.cached and 0 < following.read_bytes <= job.read_bytes)


SLICE, ABSMAX, REUSE = "slice", "absmax", "reuse"  # read and write; read for pass 1; pass 2 of the last one read
