"""The export's reader (inspect_tool/fp8_export/box_reads.py) reads the next array's first box while the last box
of this one is processed exactly when the budget of two boxes of this one covers it."""

from types import SimpleNamespace

from inspect_tool.fp8_export import box_reads


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


def _job(name, read_bytes, ahead=True, cached=False, stored=None):
  return SimpleNamespace(leaf=SimpleNamespace(key=(name,)), read_bytes=read_bytes, ahead=ahead, cached=cached,
                         stored=stored, chunk=())


def _asked_after_first_take(a, b):
  source = _Source()
  reads = box_reads.BoxReads(source, [(a, (), box_reads.SLICE), (b, (), box_reads.SLICE)])
  assert reads.take() == ("a",)
  return source.asked


def test_the_next_arrays_box_is_read_ahead_when_it_is_no_larger():
  assert _asked_after_first_take(_job("a", 100), _job("b", 100)) == [("a",), ("b",)]


def test_no_read_ahead_into_a_larger_box_a_cached_one_or_without_room_for_two():
  assert _asked_after_first_take(_job("a", 100), _job("b", 101)) == [("a",)]
  assert _asked_after_first_take(_job("a", 100), _job("b", 50, cached=True)) == [("a",)]
  assert _asked_after_first_take(_job("a", 100, ahead=False), _job("b", 50)) == [("a",)]
  assert _asked_after_first_take(_job("a", 100, stored={}), _job("b", 50)) == [("a",)]


def test_within_an_array_the_next_box_is_read_ahead_when_two_fit():
  a = _job("a", 100)
  source = _Source()
  reads = box_reads.BoxReads(source, [(a, (), box_reads.SLICE), (a, (), box_reads.SLICE)])
  reads.take()
  assert source.asked == [("a",), ("a",)]
