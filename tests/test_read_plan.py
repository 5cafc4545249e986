"""`read_plan`: reads are boxes of whole source chunks, slices tile them, read-ahead only when two boxes fit, two
passes only when no one-pass box fits, and the floor it names is exactly the least memory some plan fits in."""

from __future__ import annotations

import itertools
import math

import pytest

from inspect_tool.streaming import budget
from inspect_tool.streaming import read_plan

ITEM = 4


def _overhead(chunk):
  """Two chunks decoded at once, at most as many as the box has (`read.CheckpointSource.read_overhead`)."""
  def overhead(box):
    chunks = math.prod(-(-b // c) for b, c in zip(box, chunk))
    return min(2, chunks) * math.prod(chunk) * ITEM
  return overhead


def _stored(chunk, ratio=0.5):
  """Stored bytes of the chunks decoded at once, `ratio` of their decoded bytes (`CheckpointSource.cached_overhead`)."""
  return lambda box: int(ratio * _overhead(chunk)(box))


def _need(found, chunk, stored=None) -> int:
  nbytes = lambda block: math.prod(block) * ITEM  # pylint: disable=unnecessary-lambda-assignment
  if found.cached:  # the box's decoded chunks in a cache, their stored bytes while decoding, the slices
    return nbytes(found.box) + stored(found.box) + budget.SLICE_FACTOR * nbytes(found.block)
  return ((1 + found.ahead) * (nbytes(found.box) + _overhead(chunk)(found.box))
          + budget.SLICE_FACTOR * nbytes(found.block))


CASES = [  # shape, chunk, channel axes (one pass may cut these), absmax (two passes allowed)
    ((64, 3, 512, 256), (10, 3, 512, 256), (1, 3), True),  # experts chunked along an axis the scales share
    ((8, 2, 256, 512), (8, 2, 128, 128), (1, 3), True),  # Orbax's chunk_byte_size chunks, straddling axis 2
    ((4096, 512), (4096, 512), (0, 1), False),  # a copy in one chunk (a default local Orbax save)
    ((4096, 512), (1024, 512), (1,), False),  # rows shared, chunked along them: one pass must span them
]


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("shape,chunk,channels,absmax", CASES)
def test_every_plan_is_chunk_aligned_fits_and_the_floor_is_exact(shape, chunk, channels, absmax, cached):
  stored = _stored(chunk) if cached else None
  args = dict(channel_axes=channels, two_pass_allowed=absmax, overhead=_overhead(chunk), stored=stored)
  floor = read_plan.floor(shape, ITEM, chunk, **args)
  assert read_plan.plan_reads(shape, ITEM, chunk, floor - 1, **args) is None
  for available in (floor, floor + 1000, int(floor * 1.5), 3 * floor, 40 * floor):
    found = read_plan.plan_reads(shape, ITEM, chunk, available, **args)
    assert found is not None and found.need == _need(found, chunk, stored) <= available, (available, found)
    assert not found.cached or (stored and not found.ahead and found.box != found.block), found
    for box, side, c, d in zip(found.box, found.block, chunk, shape):
      assert box % min(c, d) == 0 or box == d, found  # whole chunks: no chunk is decoded for two boxes
      assert box % side == 0 or box == d, found  # slices tile each box
    if not found.two_pass:  # one pass: the box spans every axis the scales are shared over
      assert all(b == d for axis, (b, d) in enumerate(zip(found.box, shape)) if axis not in channels), found
    if found.ahead:  # read-ahead only when two boxes and their decoding fit
      assert 2 * (math.prod(found.box) * ITEM + _overhead(chunk)(found.box)) <= available


def test_read_ahead_needs_two_boxes_and_two_passes_only_when_one_pass_does_not_fit():
  shape, chunk = (8, 2, 256, 512), (8, 2, 128, 128)  # 1 MiB chunks; a one-pass box spans axes 0 and 2: 2 MiB
  args = dict(channel_axes=(1, 3), two_pass_allowed=True, overhead=_overhead(chunk))
  tight = read_plan.plan_reads(shape, ITEM, chunk, 3 * 2**20 + 2**18, **args)  # one chunk, its decoding, slices
  assert tight.two_pass and tight.box == chunk and not tight.ahead
  one_pass = read_plan.plan_reads(shape, ITEM, chunk, 5 * 2**20, **args)
  assert not one_pass.two_pass and one_pass.box == (8, 2, 256, 128) and not one_pass.ahead  # cut in memory
  assert one_pass.block[3] < 128
  roomy = read_plan.plan_reads(shape, ITEM, chunk, 64 * 2**20, **args)
  assert not roomy.two_pass and roomy.ahead and roomy.box == roomy.block


def test_slices_tile_a_box_and_chunks_touched_counts_whole_chunks():
  box = (slice(8, 16), slice(0, 10))
  parts = read_plan.slices_in(box, (3, 10))
  assert parts == [(slice(8, 11), slice(0, 10)), (slice(11, 14), slice(0, 10)), (slice(14, 16), slice(0, 10))]
  assert read_plan.chunks_touched((slice(8, 16), slice(0, 10)), (4, 10)) == 2
  assert read_plan.chunks_touched((slice(6, 9), slice(0, 10)), (4, 10)) == 2  # a box across a chunk edge
  assert read_plan.covered((slice(6, 9), slice(0, 10)), (4, 10), (10, 10)) == 6 * 10  # rows 4..10 decoded
  cells = set(itertools.product(range(4), range(2)))
  assert sum(read_plan.chunks_touched(b, (2, 5)) for b in read_plan.boxes((8, 10), (4, 10))) == len(cells)


def test_a_one_chunk_array_is_cached_under_twice_its_chunk():
  """One chunk of 8 MiB, stored in half that: cut in memory it needs the box and the chunk decoded beside it (16
  MiB and slices); cached, the chunk and its stored bytes (12 MiB and slices), and that is the floor."""
  shape = chunk = (4096, 512)
  args = dict(channel_axes=(1,), two_pass_allowed=False, overhead=_overhead(chunk))
  one_chunk = math.prod(chunk) * ITEM
  slice_min = budget.SLICE_FACTOR * 4096 * ITEM
  assert read_plan.floor(shape, ITEM, chunk, **args) == 2 * one_chunk + slice_min
  floor = read_plan.floor(shape, ITEM, chunk, **args, stored=_stored(chunk))
  assert floor == one_chunk + one_chunk // 2 + slice_min
  assert read_plan.plan_reads(shape, ITEM, chunk, 2 * one_chunk, **args) is None
  found = read_plan.plan_reads(shape, ITEM, chunk, 2 * one_chunk, **args, stored=_stored(chunk))
  assert found.cached and not found.ahead and found.box == shape and found.block[1] < 512, found
  roomy = read_plan.plan_reads(shape, ITEM, chunk, 40 * one_chunk, **args, stored=_stored(chunk))
  assert not roomy.cached and roomy.box == roomy.block == shape  # read whole when it fits whole
