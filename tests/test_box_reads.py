"""The export's reader (inspect_tool/streaming/box_reads.py): while one box is processed, up to two of the next
ones (within the array or across arrays) are read in the background exactly as far as the room the plan had holds
them with their slices; never for or during a cached box, never past a copy of stored chunks."""

import random
from types import SimpleNamespace

from inspect_tool.streaming import box_reads
from inspect_tool.streaming.budget import SLICE_FACTOR

ROOMY = 10**9


class _Source:
  """Records which boxes were asked for, in order."""

  def __init__(self):
    self.asked = []

  def open(self, key):
    return key

  def read_async(self, store, index):
    self.asked.append(store)
    return SimpleNamespace(result=lambda: store)

  def read_stored_async(self, store, keys):
    return self.read_async(store, keys)

  def cached_box(self, key, index):
    self.asked.append(("cached",) + key)
    return key


def _job(name, read_bytes, room=ROOMY, ahead=True, cached=False, stored=None, slice_bytes=None):
  return SimpleNamespace(leaf=SimpleNamespace(key=(name,)), read_bytes=read_bytes, ahead=ahead, cached=cached, streamed=False,
                         stored=stored, chunk=(), room=room,
                         slice_bytes=read_bytes if slice_bytes is None else slice_bytes)


def _asked_after_first_take(*jobs):
  source = _Source()
  reads = box_reads.BoxReads(source, [(job, (), box_reads.SLICE) for job in jobs])
  assert reads.take() in (("a",), "a")
  return source.asked


def test_the_next_two_boxes_are_read_ahead_when_the_room_holds_them():
  jobs = [_job(name, 100) for name in "abcd"]
  assert _asked_after_first_take(*jobs) == [("a",), ("b",), ("c",)]  # at most MAX_AHEAD = 2 in flight
  assert box_reads.MAX_AHEAD == 2


def test_read_ahead_stops_where_the_room_ends():
  exactly_two = 2 * 100 + SLICE_FACTOR * 100  # this box and one more, with a slice of either
  jobs = [_job("a", 100, room=exactly_two)] + [_job(name, 100) for name in "bc"]
  assert _asked_after_first_take(*jobs) == [("a",), ("b",)]
  jobs = [_job("a", 100, room=exactly_two - 1)] + [_job(name, 100) for name in "bc"]
  assert _asked_after_first_take(*jobs) == [("a",)]
  # a next array with larger slices needs room for them
  assert _asked_after_first_take(_job("a", 100, room=exactly_two), _job("b", 100, slice_bytes=101)) == [("a",)]
  assert _asked_after_first_take(_job("a", 100), _job("b", 5000)) == [("a",), ("b",)]  # larger, and it fits


def test_writes_in_flight_take_their_share_of_the_room():
  """What the writer's writes in flight hold counts beside the boxes: a read ahead that fits with them starts,
  one byte more and it waits; `held` is the box taken and the reads in flight, as their plans count them."""
  room = 2 * 100 + SLICE_FACTOR * 100 + 50
  for writes, asked in ((50, [("a",), ("b",)]), (51, [("a",)])):
    source = _Source()
    reads = box_reads.BoxReads(source, [(_job(n, 100, room=room), (), box_reads.SLICE) for n in "ab"],
                               lambda writes=writes: writes)
    assert reads.held() == 0
    reads.take()
    assert source.asked == asked and reads.held() == 100 * len(asked)


def test_no_read_ahead_for_or_during_a_cached_box_or_past_a_copy_of_stored_chunks():
  assert _asked_after_first_take(_job("a", 100), _job("b", 50, cached=True)) == [("a",)]
  assert _asked_after_first_take(_job("a", 100, cached=True), _job("b", 50)) == [("cached", "a")]
  assert _asked_after_first_take(_job("a", 100, stored={}), _job("b", 50)) == [("a",)]


def test_a_copy_of_stored_chunks_reads_its_own_next_box_only_when_its_plan_holds_two():
  for ahead, expected in ((True, [("a",), ("a",)]), (False, [("a",)])):
    a = _job("a", 100, stored={}, ahead=ahead)
    source = _Source()
    reads = box_reads.BoxReads(source, [(a, (), box_reads.SLICE)] * 3)
    reads.take()
    assert source.asked == expected


def test_what_is_held_never_passes_the_room_and_boxes_come_back_in_order():
  """Random jobs whose own plans fit the room: after every take, the box taken, the reads in flight and
  SLICE_FACTOR times their largest slice fit in the room; every box is read once, in order; `read_ahead` counts
  the boxes that were in flight when their turn came."""
  rng = random.Random(7)
  room = 10_000
  ahead_in_all = 0
  for _ in range(200):
    work = []
    for n in range(rng.randint(1, 12)):
      slice_bytes = rng.randint(1, 600)
      read_bytes = rng.randint(slice_bytes, room - SLICE_FACTOR * slice_bytes)  # the plan of one box fits
      job = _job(f"j{n}", read_bytes, room=room, cached=rng.random() < 0.1, slice_bytes=slice_bytes)
      kinds = [box_reads.SLICE] * rng.randint(1, 3) + ([box_reads.REUSE] if rng.random() < 0.2 else [])
      work += [(job, (i,), kind) for i, kind in enumerate(kinds)]
    source = _Source()
    reads = box_reads.BoxReads(source, work)
    ahead = 0  # boxes already in flight when their turn came (the first one is started by the constructor)
    for i, (job, _, kind) in enumerate(work):
      ahead += i > 0 and kind != box_reads.REUSE and i in [n for n, _, _ in reads._queue]  # pylint: disable=protected-access
      value = reads.take()
      if kind != box_reads.REUSE:
        assert value == job.leaf.key
      in_flight = [work[n] for n, _, _ in reads._queue]  # pylint: disable=protected-access
      assert len(in_flight) <= box_reads.MAX_AHEAD
      held = job.read_bytes + sum(j.read_bytes for j, _, k in in_flight if k != box_reads.REUSE)
      if in_flight:
        assert held + SLICE_FACTOR * max(j.slice_bytes for j, _, _ in [work[i], *in_flight]) <= room
    asked = [work[i][0].leaf.key if not work[i][0].cached else ("cached",) + work[i][0].leaf.key
             for i in range(len(work)) if work[i][2] != box_reads.REUSE]
    assert source.asked == asked
    assert reads.read_ahead == ahead  # what the report's `boxes_read_ahead` says
    ahead_in_all += ahead
  assert ahead_in_all > 100
