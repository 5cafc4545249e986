"""How one source array is read within the memory budget: chunk-aligned boxes, cut in memory into slices.

A source chunk is the least a read can decode, so every read is a *box* whose sides are whole multiples of the
source's chunk sides (or the whole axis): no box cuts a chunk that the next box would decode again. A box is
processed (quantized, copied) in *slices*, blocks whose sides divide the box's, cut in memory when the box is
bigger than a slice may be. A weight is quantized in one pass when its boxes span every axis its scales are
shared over; otherwise (absmax scales only) in two passes over boxes that share channels, each box decoded twice.

Memory of a read plan, beside what the process holds:
  (1 + ahead) * (box bytes + the source's decode overhead of a box) + `budget.SLICE_FACTOR` * slice bytes,
where `ahead` (the next box read while this one is processed) is taken only when the budget holds two boxes, and
the decode overhead is what the source holds while decoding (`CheckpointSource.read_overhead`: the stored and
the decoded bytes of the chunks it decodes at once). A smallest box cut in memory may instead be *cached*: its slices
are read one after another through a chunk cache that holds the box's decoded chunks (`read.cached_box`), each
chunk decoded once, by the first slice that touches it; then memory holds
  box bytes (its decoded chunks) + `stored(box)` (the stored bytes of the chunks decoded at once) +
  `budget.SLICE_FACTOR` * slice bytes,
without read-ahead: for a box of one chunk, one chunk and its stored bytes instead of the box and the chunk.
An array stored as one chunk (Orbax's layout below its chunk cap) may instead be *streamed*
(`chunk_stream.ChunkStream`): its stored bytes decoded front to back into boxes of any size along the leading
axes it may be cut along (each box one run of the array in C order), read in order, the chunk decoded once per
pass; memory holds the boxes as above with the stream's windows (`stream`) as their decode overhead. Streamed
whole boxes are planned after whole boxes of chunks, a streamed box cut in memory last (`plan_reads`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from inspect_tool.streaming import budget


@dataclasses.dataclass(frozen=True)
class ReadPlan:
  """One array's reads: `box` (chunk-aligned), `block` (the slice, dividing the box), passes, read-ahead."""

  box: tuple[int, ...]
  block: tuple[int, ...]
  two_pass: bool
  ahead: bool
  need: int  # bytes beyond what the process holds
  cached: bool = False  # the box's slices are read through a chunk cache holding its chunks, not cut in memory
  streamed: bool = False  # the array's one chunk is decoded front to back into boxes contiguous in C order


def minimal_box(shape: Sequence[int], chunk: Sequence[int] | None, cuttable: Sequence[int]) -> tuple[int, ...]:
  """The smallest chunk-aligned box: one chunk (one index when the chunking is unknown) along each `cuttable`
  axis, the whole of every other axis."""
  return tuple(min(int(chunk[axis]) if chunk and chunk[axis] else 1, int(d)) if axis in cuttable else int(d)
               for axis, d in enumerate(shape))


def aligned_box(shape: Sequence[int], chunk: Sequence[int] | None, itemsize: int, limit: int,
                cuttable: Sequence[int]) -> tuple[int, ...]:
  """The largest box of at most `limit` bytes whose sides along `cuttable` axes are whole multiples of `chunk`'s
  (or the whole axis), cut outermost first; `minimal_box` when even that is over `limit`."""
  box = [int(d) for d in shape]
  floor = minimal_box(shape, chunk, cuttable)
  for axis in sorted(set(cuttable)):
    size = math.prod(box) * itemsize
    if size <= limit:
      break
    side = max(floor[axis], 1)
    per_index = size // max(box[axis], 1)
    most = max(1, limit // max(per_index, 1))
    count = max(1, most // side)
    chunks = -(-box[axis] // side)
    for k in range(count, max(1, -(-count // 2)) - 1, -1):  # equal boxes where a near count divides the chunks
      if chunks % k == 0:
        count = k
        break
    box[axis] = min(box[axis], count * side)
  return tuple(box)


def slice_block(shape: Sequence[int], box: Sequence[int], itemsize: int, limit: int,
                cuttable: Sequence[int]) -> tuple[int, ...] | None:
  """The largest slice of at most `limit` bytes within `box`, cutting `cuttable` axes outermost first, whose side
  divides the box's along every axis the box cuts (so the slices of the array are a regular grid that never
  crosses a box); None when a slice of 1 along every cuttable axis is over `limit`."""
  block = [int(b) for b in box]
  for axis in sorted(set(cuttable)):
    size = math.prod(block) * itemsize
    if size <= limit:
      break
    per_index = size // max(block[axis], 1)
    most = max(1, min(block[axis], limit // max(per_index, 1)))
    if block[axis] < int(shape[axis]):
      block[axis] = next(d for d in range(most, 0, -1) if block[axis] % d == 0)
    else:
      block[axis] = budget._even_block(block[axis], most)  # pylint: disable=protected-access
  if math.prod(block) * itemsize > limit:
    return None
  return tuple(block)


def _nbytes(block: Sequence[int], itemsize: int) -> int:
  return math.prod(int(d) for d in block) * itemsize


def plan_reads(shape: Sequence[int], itemsize: int, chunk: Sequence[int] | None, available: int, *,
               channel_axes: Sequence[int], two_pass_allowed: bool,
               overhead: Callable[[Sequence[int]], int],
               stored: Callable[[Sequence[int]], int] | None = None, stream: int | None = None) -> ReadPlan | None:
  """The read plan of an array within `available` bytes (None: none fits): one pass before two, then whole boxes
  (with read-ahead, then without), streamed whole boxes (with `stream`), a smallest box cut in memory with
  read-ahead, cached (with `stored`), cut in memory without read-ahead, and a streamed box cut in memory. (A box
  cut in memory reads its slices faster from a cached chunk than from a streamed box: measured on
  `bench/bench_export.py`'s one-chunk source.)

  `channel_axes`: the axes a one-pass slice may be cut along (a quantized weight's channels; every axis for a
  copy); `two_pass_allowed`: the weight may be quantized in two passes (then boxes and slices cut every axis);
  `overhead(box)`: what the source holds beyond the box while decoding it; `stored(box)`: beyond the box's decoded
  chunks while decoding them into a cache (None: the source has no cached reads); `stream`: what a streamed read
  holds beside its box (None: the array is not one chunk that can be streamed, `read.CheckpointSource.stream_overhead`).
  """
  every = tuple(range(len(shape)))
  modes = [(False, tuple(channel_axes))]
  if two_pass_allowed and set(channel_axes) != set(every):
    modes.append((True, every))
  for two_pass, cuttable in modes:
    found = _fit(shape, itemsize, chunk, available, cuttable, overhead, stored, _streamed(shape, cuttable, stream))
    if found is not None:
      box, block, ahead, need, cached, streamed = found
      return ReadPlan(box, block, two_pass, ahead, need, cached, streamed)
  return None


def _streamed(shape: Sequence[int], cuttable: Sequence[int], stream: int | None):
  """(chunk, cuttable axes, overhead) of streamed reads: boxes of any side along the leading cuttable axes, so
  that every box is one run of the array in C order (`chunk_stream.contiguous_range`); None without `stream`."""
  if stream is None:
    return None
  prefix = 0
  while prefix < len(shape) and prefix in cuttable:
    prefix += 1
  return (1,) * len(shape), tuple(range(prefix)), lambda box: stream


def _need(box, block, itemsize: int, ahead: bool, overhead) -> int:
  return (1 + ahead) * (_nbytes(box, itemsize) + int(overhead(box))) + budget.SLICE_FACTOR * _nbytes(block, itemsize)


def _cached_need(box, block, itemsize: int, stored) -> int:
  return _nbytes(box, itemsize) + int(stored(box)) + budget.SLICE_FACTOR * _nbytes(block, itemsize)


def _fit(shape, itemsize, chunk, available, cuttable, overhead, stored=None, streamed=None):
  ones, prefix, held = streamed or (None, None, None)  # streamed: boxes along the leading cuttable axes
  attempts = [(lambda: _whole_boxes(shape, itemsize, chunk, available, cuttable, overhead), False),
              (lambda: _whole_boxes(shape, itemsize, ones, available, prefix, held), True),
              (lambda: _cut_boxes(shape, itemsize, chunk, available, cuttable, overhead, stored), False),
              (lambda: _cut_boxes(shape, itemsize, ones, available, prefix, held, slice_axes=cuttable), True)]
  for attempt, is_stream in attempts:
    found = None if is_stream and streamed is None else attempt()
    if found is not None:
      return (*found[:5], is_stream)
  return None


def _whole_boxes(shape, itemsize, chunk, available, cuttable, overhead):
  for ahead in (True, False):  # whole boxes, each read once into a slice of its own
    limit = (available - (1 + ahead) * int(overhead(minimal_box(shape, chunk, cuttable)))) // (
        1 + ahead + budget.SLICE_FACTOR)
    for _ in range(4):
      if limit <= 0:
        break
      box = aligned_box(shape, chunk, itemsize, limit, cuttable)
      if _nbytes(box, itemsize) <= limit and _need(box, box, itemsize, ahead, overhead) <= available:
        return box, box, ahead, _need(box, box, itemsize, ahead, overhead), False
      limit = limit * 3 // 4
  return None


def _cut_boxes(shape, itemsize, chunk, available, cuttable, overhead, stored=None, slice_axes=None):
  box = minimal_box(shape, chunk, cuttable)  # one box, cut in memory (or cached)
  for ahead, cached in ((True, False), (False, True), (False, False)):
    if (cached and stored is None) or (ahead and box == tuple(int(d) for d in shape)):
      continue  # no cache; nothing to read ahead of the only box
    held = _nbytes(box, itemsize) + int(stored(box)) if cached else (1 + ahead) * (
        _nbytes(box, itemsize) + int(overhead(box)))
    room = (available - held) // budget.SLICE_FACTOR
    block = slice_block(shape, box, itemsize, room, slice_axes or cuttable) if room > 0 else None
    if block is not None:
      need = _cached_need(box, block, itemsize, stored) if cached else _need(box, block, itemsize, ahead, overhead)
      return box, block, ahead, need, cached, False
  return None


def plan_boxes(shape: Sequence[int], itemsize: int, chunk: Sequence[int] | None, available: int,
               cuttable: Sequence[int], overhead: Callable[[Sequence[int]], int],
               cached: bool = False, stream: int | None = None) -> tuple[tuple[int, ...], bool, bool, bool]:
  """(box, ahead, cached, streamed) for reading an array whose work beside the boxes is already taken from
  `available`: the largest chunk-aligned box of which two (`ahead`) fit with their decode overhead, else one; else,
  with `stream` (`plan_reads`), the largest streamed box (one run of the array), two or one; else the smallest
  box, streamed when the array can be, else read through a chunk cache (`cached`) when the source has one."""
  smallest = minimal_box(shape, chunk, cuttable)
  for ahead in (True, False):
    limit = available // (1 + ahead) - int(overhead(smallest))
    box = aligned_box(shape, chunk, itemsize, max(limit, 0), cuttable)
    if (1 + ahead) * (_nbytes(box, itemsize) + int(overhead(box))) <= available:
      return box, ahead, cached and not ahead and box == smallest, False
  streamed = _streamed(shape, cuttable, stream)
  if streamed is None:
    return smallest, False, cached, False
  ones, prefix, _ = streamed
  for ahead in (True, False):
    box = aligned_box(shape, ones, itemsize, max(available // (1 + ahead) - stream, 0), prefix)
    if (1 + ahead) * (_nbytes(box, itemsize) + stream) <= available:
      return box, ahead, False, True
  return streamed_box(shape, cuttable), False, False, True


def streamed_box(shape: Sequence[int], cuttable: Sequence[int]) -> tuple[int, ...]:
  """The smallest streamed box (`plan_boxes`) of an array read along `cuttable` axes."""
  return minimal_box(shape, (1,) * len(shape), _streamed(shape, cuttable, 0)[1])


def floor(shape: Sequence[int], itemsize: int, chunk: Sequence[int] | None, *, channel_axes: Sequence[int],
          two_pass_allowed: bool, overhead: Callable[[Sequence[int]], int],
          stored: Callable[[Sequence[int]], int] | None = None, stream: int | None = None) -> int:
  """The fewest bytes (beyond what the process holds) any read plan of the array needs: a smallest box, cut into
  slices of 1 along every axis it may cut, without read-ahead, cut in memory, (with `stored`) cached or (with
  `stream`) streamed."""
  every = tuple(range(len(shape)))
  options = [tuple(channel_axes)] + ([every] if two_pass_allowed else [])
  needs = []
  for cuttable in options:
    box = minimal_box(shape, chunk, cuttable)
    block = tuple(1 if axis in cuttable else b for axis, b in enumerate(box))
    needs.append(_need(box, block, itemsize, False, overhead))
    if stored is not None:
      needs.append(_cached_need(box, block, itemsize, stored))
    if stream is not None:
      box = streamed_box(shape, cuttable)
      block = tuple(1 if axis in cuttable else b for axis, b in enumerate(box))
      needs.append(_need(box, block, itemsize, False, lambda box: stream))
  return min(needs)


def boxes(shape: Sequence[int], box: Sequence[int]) -> list[tuple[slice, ...]]:
  """Index tuples of every box of the array, in C order."""
  return list(budget.Slicing(tuple(shape), tuple(box)).slices())


def slices_in(index: tuple[slice, ...], block: Sequence[int]) -> list[tuple[slice, ...]]:
  """The slices (absolute index tuples) of `block` that tile the box `index`, in C order."""
  shape = tuple(s.stop - s.start for s in index)
  return [tuple(slice(o.start + s.start, o.start + s.stop) for o, s in zip(index, part))
          for part in budget.Slicing(shape, tuple(min(b, d) for b, d in zip(block, shape))).slices()]


def chunks_touched(index: tuple[slice, ...], chunk: Sequence[int] | None) -> int:
  """How many source chunks of `chunk`'s shape the box `index` touches (each is decoded whole for it)."""
  if not chunk:
    return 1
  return math.prod(-(-s.stop // c) - s.start // c for s, c in zip(index, chunk) if c)


def covered(index: tuple[slice, ...], chunk: Sequence[int] | None, shape: Sequence[int]) -> int:
  """Elements of the array (of `shape`) inside the chunks the box `index` touches: what reading it decodes."""
  if not chunk:
    return math.prod(s.stop - s.start for s in index)
  return math.prod(min(-(-s.stop // c) * c, d) - s.start // c * c if c else s.stop - s.start
                   for s, c, d in zip(index, chunk, shape))
