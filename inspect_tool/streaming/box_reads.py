"""The boxes of a streamed write read in order, up to `MAX_AHEAD` of the next ones read in the background while one is
processed, as far as the memory its plan had room for holds them (`write_orbax.ArrayJob.room`): within an array
and across arrays."""

from __future__ import annotations

import collections
import itertools
from typing import Sequence

from inspect_tool.output import stop
from inspect_tool.streaming import budget

MAX_AHEAD = 2  # reads in flight beside the box being processed (tensorstore decodes them in parallel)


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
  """The boxes to read, in order. Once a box is taken, the following ones are started in the background while
  `_may_start` allows: at most `MAX_AHEAD` in flight, none for or during a cached box (its view decodes as it is
  read) or past a copy of stored chunks (which may read its source again), and only while the box being
  processed, the reads in flight and the new one, plus `budget.SLICE_FACTOR` times the largest of their slices and
  what the writes in flight hold (`writes()`, bytes), fit in the room the plan had (`ArrayJob.room`; each plan
  already counts the process itself).

  `work` holds (job, index, kind) items; a `REUSE` item reads nothing (its value is the last one taken).
  """

  def __init__(self, source, work: list[tuple], writes=lambda: 0):
    self._source, self._work, self._writes = source, work, writes
    self._opened = (None, None)  # (key, tensorstore handle) of the array last opened
    self._store = None  # the handle of the array whose box was taken last
    self._queue: collections.deque = collections.deque()  # (item number, pending read, handle), in order
    self._next = 0  # the item `take` returns next
    self._started = 0  # items started so far
    self.read_ahead = 0  # boxes whose read started while an earlier one was processed
    if work:
      self._start_next()

  def _start_next(self) -> None:
    self._queue.append((self._started, *self._start(self._started)))
    self._started += 1

  def _start(self, i: int):
    job, index, kind = self._work[i]
    if kind == REUSE:
      return _Ready(), None
    if job.cached:  # a view whose slices decode the box's chunks once, into a cache of its own
      return _Ready(self._source.cached_box(job.leaf.key, index)), None
    if job.streamed:  # decoded front to back from the array's one stored chunk, in the order asked for
      return self._source.read_streamed_async(job.leaf.key, index), None
    if job.leaf.key != self._opened[0]:
      self._opened = (job.leaf.key, self._source.open(job.leaf.key))
    store = self._opened[1]
    if job.stored is not None:
      return self._source.read_stored_async(store, chunk_keys(index, job.chunk)), store
    return self._source.read_async(store, index), store

  def read_again(self, index: tuple[slice, ...]):
    """The decoded values of a slice of the array whose box was taken last (a slice whose chunks are not all
    stored)."""
    return self._source.read(self._store, index)

  def take(self):
    """The next box's values (the caller holds no other box); starts reading the following ones when allowed."""
    if not self._queue:
      self._start_next()
    number, pending, store = self._queue.popleft()
    assert number == self._next, (number, self._next)
    self._next += 1
    self._store = store if store is not None else self._store
    value = pending.result()
    while self._started < len(self._work) and self._may_start(number, self._started):
      self.read_ahead += self._work[self._started][2] != REUSE
      self._start_next()
    return value

  def _may_start(self, current: int, candidate: int) -> bool:
    """Whether the read of item `candidate` may start while item `current` (the one taken last) is processed (see
    the class)."""
    job, following = self._work[current][0], self._work[candidate][0]
    if len(self._queue) >= MAX_AHEAD or job.cached or following.cached:
      return False
    if job.stored is not None:  # its own next box only, as its plan allows (`read_again` reads this array)
      return following is job and job.ahead and not self._queue
    items = [current, *(n for n, _, _ in self._queue), candidate]
    held = self.held() + (following.read_bytes if self._work[candidate][2] != REUSE else 0)
    slices = budget.SLICE_FACTOR * max(self._work[i][0].slice_bytes for i in items)
    return held + slices + self._writes() <= job.room

  def held(self) -> int:
    """What the box taken last (held whatever its kind) and the reads in flight hold, as their plans count them."""
    if self._next == 0:
      return 0
    queued = sum(self._work[n][0].read_bytes for n, _, _ in self._queue if self._work[n][2] != REUSE)
    return self._work[self._next - 1][0].read_bytes + queued

  def close(self) -> None:
    """Waits for the reads in flight, ignoring their outcome; after a stop signal, not for them (a read that never
    ends, over a network, would hold the run past its stop)."""
    queue, self._queue = self._queue, collections.deque()
    if stop.received() is not None:
      return
    for _, pending, _ in queue:
      try:
        pending.result()
      except Exception:  # pylint: disable=broad-except
        pass


SLICE, ABSMAX, REUSE = "slice", "absmax", "reuse"  # read and write; read for pass 1; pass 2 of the last one read
