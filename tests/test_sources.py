"""The array sources' written-down interface (`streaming.source.ArraySource`): every source implements it, what a
source cannot do has its default, nothing asks a source what it is, and `Keyed` opens each array once."""

from __future__ import annotations

import ast
import inspect
import os

import numpy as np
import pytest

from inspect_tool.hf_import import source as hf_source
from inspect_tool.paramtree import tree
from inspect_tool.streaming import read
from inspect_tool.streaming import source as source_lib

from conftest import REPO
SOURCE_NAMES = {"source", "src", "arrays", "_source", "self._source"}


@pytest.mark.parametrize("cls", [read.CheckpointSource, read.InitSource, hf_source.HfSource])
def test_every_source_implements_the_interface_whole(cls):
  assert issubclass(cls, source_lib.ArraySource) and not inspect.isabstract(cls), cls.__abstractmethods__


class _Counted(source_lib.ArraySource):
  """The least a source must give: arrays in memory, chunks of one row, every open counted."""

  def __init__(self):
    self.arrays = {("a",): np.arange(12.0).reshape(4, 3), ("b",): np.ones((2, 5))}
    self.opened = []

  def leaf(self, key):
    return tree.Leaf(key, self.arrays[key].shape, "float64")

  def keys(self):
    return list(self.arrays)

  def open(self, key):
    self.opened.append(key)
    return self.arrays[key]

  def chunk_shape(self, handle):
    return (1,) + handle.shape[1:]

  def chunk_bytes(self, handle):
    return handle[:1].nbytes

  def read_overhead(self, handle, box):
    return 7 * int(np.prod(box))

  def read(self, handle, index):
    return handle[index]

  def read_async(self, handle, index):
    return read.PendingRead(None, "", value=self.read(handle, index))


def test_a_source_without_capabilities_gets_their_defaults():
  src = _Counted()
  handle = src.open(("a",))
  assert (src.stored_layout(handle), src.stream_overhead(handle), src.cached_reads, src.decoded()) == \
      (None, None, False, {})
  view = src.view(("a",))  # the array in memory, wrapped: a view with the defaults of one
  assert isinstance(view, source_lib.View) and view.array is src.arrays[("a",)] and view.shape == (4, 3)
  assert (view.cached_reads, view.stream_overhead) == (False, None) and np.asarray(view).tolist() == view[:].tolist()
  assert len(src) == 2 and ("b",) in src and list(src) == src.keys()
  for call in (lambda: src.cached_box(("a",), (slice(0, 1),)), lambda: src.cached_overhead(handle, (1, 3)),
               lambda: src.read_streamed_async(("a",), (slice(0, 1),)), lambda: src.new_stream(("a",)),
               lambda: src.read_stored_async(handle, [])):
    with pytest.raises(NotImplementedError, match="_Counted"):
      call()
  src.close_stream()  # nothing to end
  assert src.read_async(handle, (slice(1, 2),)).result().tolist() == [[3.0, 4.0, 5.0]]


def test_keyed_opens_each_array_once_and_gives_the_sources_figures_by_key():
  src = _Counted()
  keyed = source_lib.Keyed(src)
  for _ in range(3):
    assert keyed.chunk_shape(("a",)) == (1, 3) and keyed.read_overhead(("a",), (2, 3)) == 42
    assert keyed.stream_overhead(("b",)) is None and keyed.cached_overhead(("b",), (1, 5)) is None
  assert sorted(src.opened) == [("a",), ("b",)]
  keyed.clear()  # the handles go (the source views are done with); a later read opens the array again
  assert keyed.read_overhead(("a",), (1, 3)) == 21
  assert sorted(src.opened) == [("a",), ("a",), ("b",)]


def _probes(path: str) -> list[str]:
  """`hasattr(X, ...)` / `getattr(X, ..., default)` calls in `path` whose X is a source by its name."""
  found = []
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr") \
        and node.args and ast.unparse(node.args[0]) in SOURCE_NAMES:
      found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {ast.unparse(node)}")
  return found


def test_no_module_asks_a_source_what_it_is():
  """Once `hasattr(source, "cached_box")`, `hasattr(arrays, "stream_overhead")`, `getattr(src, "decodes", {})`
  told the sources apart in `write_orbax` and the export's pipeline."""
  found = []
  for package in ("inspect_tool", "quant"):
    for directory, _, files in os.walk(os.path.join(REPO, package)):
      found += [p for name in files if name.endswith(".py") for p in _probes(os.path.join(directory, name))]
  assert found == []
