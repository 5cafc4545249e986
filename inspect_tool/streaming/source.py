"""The interface every array source of the streaming writers implements: `ArraySource`.

A source gives a model's leaves by key (an Orbax checkpoint: `read.CheckpointSource`; the seeded init of a small
model: `read.InitSource`; a Hugging Face release read as MaxText's arrays: `hf_import.source.HfSource`). The writers
(`write_orbax`, `fp8_export.write_hf`, `write_v4`) plan and read through it alone: what a source cannot do has a
default here (nothing stored to copy, no stream, no chunk cache, no decodes counted), so no writer asks a source
what it is. `Keyed` gives the per-key figures the safetensors writers plan with, each array opened once.
"""

from __future__ import annotations

import abc
from typing import Any, Iterator, Sequence

import numpy as np

from inspect_tool.paramtree import tree


class View:
  """An array as the safetensors writers index it: `shape`, `dtype`, `view[index]`. What only a lazy view of a
  stored array can do has its default here, so no writer asks what a view is: `cached_reads` (a chunk-aligned box
  through a chunk cache of its own: `cached(index)`) and `stream_overhead` (None: not streamed; else the bytes a
  streamed read holds beside its box: `stream(index)`)."""

  shape: tuple[int, ...]
  dtype: Any
  cached_reads = False
  stream_overhead: int | None = None

  def __getitem__(self, index):
    raise NotImplementedError

  def cached(self, index: tuple[slice, ...]):
    raise NotImplementedError(f"{type(self).__name__} has no cached reads")

  def stream(self, index: tuple[slice, ...]):
    raise NotImplementedError(f"{type(self).__name__} has no streamed reads")


class InMemory(View):
  """An array in memory (anything with `shape`, `dtype` and indexing) as a `View`."""

  def __init__(self, array):
    self.array, self.shape, self.dtype = array, tuple(int(d) for d in array.shape), array.dtype

  def __getitem__(self, index):
    return self.array[index]

  def __array__(self, dtype=None, copy=None):  # pylint: disable=unused-argument
    return np.asarray(self.array, dtype)


def as_view(value) -> View:
  """`value` as a `View`: a source's view as it is, an array in memory wrapped."""
  return value if isinstance(value, View) else InMemory(value)


class ArraySource(abc.ABC):
  """Arrays by model leaf key, read box by box. `open(key)` gives the handle the other calls take (a tensorstore
  array, an in-memory array, the key itself); a box is a tuple of slices."""

  cached_reads = False  # whether `cached_box` / `cached_overhead` read through a chunk cache of their own

  @abc.abstractmethod
  def leaf(self, key: tuple[str, ...]) -> tree.Leaf:
    """The stored leaf (shape, dtype) of model leaf `key`."""

  @abc.abstractmethod
  def keys(self) -> list[tuple[str, ...]]:
    """Every model leaf key the source holds."""

  @abc.abstractmethod
  def open(self, key: tuple[str, ...]) -> Any:
    """The handle of `key`'s array."""

  @abc.abstractmethod
  def chunk_shape(self, handle) -> tuple[int, ...] | None:
    """The shape one read decodes whole (a stored chunk), or None: already in memory."""

  @abc.abstractmethod
  def chunk_bytes(self, handle) -> int:
    """The bytes one decoded chunk holds (0: nothing decoded)."""

  @abc.abstractmethod
  def read_overhead(self, handle, box: Sequence[int]) -> int:
    """Bytes held beyond a box of shape `box` while it is read."""

  @abc.abstractmethod
  def read(self, handle, index: tuple[slice, ...]):
    """The values of the box `index`."""

  @abc.abstractmethod
  def read_async(self, handle, index: tuple[slice, ...]):
    """Starts reading the box `index`; the returned object's `result()` waits for its values."""

  def stored_layout(self, handle) -> dict | None:  # pylint: disable=unused-argument
    """The zarr3 metadata of an array whose stored chunks may be copied as they are; None: always converted."""
    return None

  def stream_overhead(self, handle) -> int | None:  # pylint: disable=unused-argument
    """Bytes a streamed read of a one-chunk array holds beside its box; None: not streamed."""
    return None

  def cached_overhead(self, handle, box: Sequence[int]) -> int:
    """Bytes held beyond the decoded chunks of a box read through a chunk cache (only with `cached_reads`)."""
    raise NotImplementedError(f"{type(self).__name__} has no cached reads")

  def cached_box(self, key: tuple[str, ...], index: tuple[slice, ...]):
    """The box `index` of `key` as a lazy view over a chunk cache of its own (only with `cached_reads`)."""
    raise NotImplementedError(f"{type(self).__name__} has no cached reads")

  def read_stored_async(self, handle, chunk_keys: list[str]):
    """Starts reading the stored bytes of chunks, to be copied as they are (only where `stored_layout` is)."""
    raise NotImplementedError(f"{type(self).__name__} stores nothing to copy")

  def read_streamed_async(self, key: tuple[str, ...], index: tuple[slice, ...]):
    """Starts decoding the box `index` of a one-chunk array front to back (only where `stream_overhead` is)."""
    raise NotImplementedError(f"{type(self).__name__} has no streamed reads")

  def new_stream(self, key: tuple[str, ...]):
    """A stream of its own over `key`'s one stored chunk (only where `stream_overhead` is)."""
    raise NotImplementedError(f"{type(self).__name__} has no streamed reads")

  def view(self, key: tuple[str, ...]) -> View:
    """`key`'s array as the safetensors writers index it (a lazy view, or the array wrapped)."""
    return as_view(self.open(key))

  def decoded(self) -> dict[tuple[str, ...], list[int]]:
    """Chunks and bytes decoded so far, per model leaf key ({}: nothing is decoded)."""
    return {}

  def close_stream(self) -> None:
    """Ends the streamed reads still running (none by default)."""

  def close(self) -> None:
    """Gives back what the source holds (threads, handles)."""

  def __getitem__(self, key: tuple[str, ...]):
    return self.open(key)

  def __iter__(self) -> Iterator[tuple[str, ...]]:
    return iter(self.keys())

  def __len__(self) -> int:
    return len(self.keys())

  def __contains__(self, key) -> bool:
    return key in set(self.keys())


class Keyed:
  """A source's figures per model leaf key, each array opened once: what the safetensors writers plan with."""

  def __init__(self, source: ArraySource):
    self.source = source
    self._handles: dict[tuple[str, ...], Any] = {}
    self._chunks: dict[tuple[str, ...], tuple[int, ...] | None] = {}

  def handle(self, key: tuple[str, ...]):
    if key not in self._handles:
      self._handles[key] = self.source.open(key)
    return self._handles[key]

  def chunk_shape(self, key: tuple[str, ...]) -> tuple[int, ...] | None:
    if key not in self._chunks:
      self._chunks[key] = self.source.chunk_shape(self.handle(key))
    return self._chunks[key]

  def read_overhead(self, key: tuple[str, ...], box: Sequence[int]) -> int:
    return self.source.read_overhead(self.handle(key), box) if self.chunk_shape(key) else 0

  def cached_overhead(self, key: tuple[str, ...], box: Sequence[int]) -> int | None:
    """None where the source has no cached reads."""
    return self.source.cached_overhead(self.handle(key), box) if self.source.cached_reads else None

  def stream_overhead(self, key: tuple[str, ...]) -> int | None:
    return self.source.stream_overhead(self.handle(key))

  def clear(self) -> None:
    self._handles.clear()
