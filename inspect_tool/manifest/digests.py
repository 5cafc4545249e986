"""The sha256 of every tensor an export writes (and a scale tensor's zero, NaN and inf counts), fed with the values
as the writers hand them over: no second read of the output.

The manifest's hash is that of a tensor's elements in C order (`stored`). A writer gives a tensor's values as boxes
(`add`): a box that continues the C-order stream where the hash stands is hashed at once. From the first box that
does not on (a quantized weight cut along its channels, whose C order runs across every slice: the routed experts
(E, L, K, N) written layer by layer; the boxes of a second pass, back to front), the tensor is assembled instead:
each box copied to its place in a C-order buffer of the tensor's size, where the writer's plan has room for one
(`track(..., memory=)`; the buffers are `held_bytes`, and one whose tensor is hashed is used again for the next, so
that its pages are not fresh ones each time); else each box appended to a scratch file (unnamed, on the export's
file system; also used again), from which the rest of the stream is gathered in C-order windows of `WINDOW_BYTES`
once every element has come; else (`scratch=False`: nothing on local disk) the tensor is dropped, for the caller
to read back. Either way the rest is hashed when the tensor is complete.

`Digests(background=True)` (the Orbax writer) does that work in two threads of its own: one takes the boxes in the
order given (`add` returns its future, which the writer counts among its writes in flight), the other hashes the
tensors assembled. `background=False` (the safetensors writer, whose tensors are always written front to back)
hashes in the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import tempfile
import threading
from typing import Callable

import numpy as np

from inspect_tool.manifest import stored

WINDOW_BYTES = 4 << 20  # the C-order window gathered from a scratch file at once


def counts(values: np.ndarray) -> list[int]:
  """[zero, NaN, inf] counts of an array of scales."""
  values = np.asarray(values, np.float32)
  return [int(np.count_nonzero(values == 0)), int(np.count_nonzero(np.isnan(values))),
          int(np.count_nonzero(np.isinf(values)))]


def run_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
  """(first element, elements) of the box `index` of an array of `shape` when the box is one run of the array in C
  order; None when it is not."""
  sides = [s.stop - s.start for s in index]
  lead = next((a for a, side in enumerate(sides) if side != 1), len(sides))
  if any(side != d for side, d in zip(sides[lead + 1:], shape[lead + 1:])):
    return None
  first = 0
  for s, d in zip(index, shape):
    first = first * d + s.start
  return first, math.prod(sides)


class ArrayHash:
  """The sha256 of one tensor's elements in C order, fed by boxes in any order (see the module). `room` gives the
  means to assemble it when the first box out of order comes: a C-order buffer of `nbytes` (uint8) or a scratch
  file (its argument: the bytes needed), and takes them back once the tensor is hashed."""

  def __init__(self, shape, dtype, counted: bool = False, room=None):
    self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
    self.total = math.prod(self.shape)
    self.received = 0  # elements given
    self.position = 0  # elements hashed, in C order
    self.counts = [0, 0, 0] if counted else None
    self._sha = hashlib.sha256()
    self._room = room or _Room()
    self._buffer = None  # the C-order buffer (uint8), from the first box out of order on
    self._file = None  # or the scratch file, with the boxes appended to it: (box, offset) in `_boxes`
    self.dropped = False  # out of C order with neither: not hashed here (read back once written)
    self._boxes: list[tuple[tuple[slice, ...], int]] = []
    self._end = 0  # bytes appended to the scratch file

  @property
  def complete(self) -> bool:
    return self.received == self.total

  @property
  def assembling(self) -> bool:
    return self._buffer is not None or self._file is not None

  def add(self, index: tuple[slice, ...] | None, value: np.ndarray) -> None:
    """Adds the box `index` (None: the elements that follow the last ones given, in C order) of the tensor."""
    value = np.ascontiguousarray(value, self.dtype)
    self.received += value.size
    if self.dropped:
      return
    if self.counts is not None:
      for i, n in enumerate(counts(value)):
        self.counts[i] += n
    run = (self.received - value.size, value.size) if index is None else run_of(tuple(index), self.shape)
    if not self.assembling and run is not None and run[0] == self.position:
      self._sha.update(value.reshape(-1).view(np.uint8))
      self.position += run[1]
    elif index is None:
      raise ValueError(f"values appended to a tensor of shape {self.shape} after a box out of C order")
    else:
      self._assemble(tuple(index), value)

  def _assemble(self, index: tuple[slice, ...], value: np.ndarray) -> None:
    if not self.assembling:
      self._buffer, self._file = self._room.take(self.total * self.dtype.itemsize)
      self._end, self.dropped = 0, self._buffer is None and self._file is None
      if self.dropped:
        return
    if self._buffer is not None:
      self._buffer.view(self.dtype).reshape(self.shape)[index] = value
      return
    view = memoryview(value.reshape(-1).view(np.uint8))
    self._boxes.append((index, self._end))
    while view:
      written = os.pwrite(self._file.fileno(), view, self._end)
      view, self._end = view[written:], self._end + written

  def hexdigest(self) -> str | None:
    """The hash of the complete tensor: the rest of its C-order stream, from its buffer or its scratch file (None:
    dropped)."""
    assert self.complete, (self.received, self.total)
    if self.dropped:
      return None
    try:
      if self._buffer is not None:
        self._sha.update(self._buffer[self.position * self.dtype.itemsize:])
      elif self._file is not None:
        self._gather()
    finally:
      self.discard()
    return self._sha.hexdigest()

  def _gather(self) -> None:
    itemsize = self.dtype.itemsize
    window, piece = (np.empty(max(1, WINDOW_BYTES // itemsize), self.dtype) for _ in range(2))
    for box in stored.slabs(self.shape, itemsize, WINDOW_BYTES):
      first, size = run_of(box, self.shape)
      if first + size <= self.position:
        continue
      part = window[:size].reshape(tuple(s.stop - s.start for s in box))
      for index, offset in self._boxes:
        self._copy_into(part, box, index, offset, piece)
      self._sha.update(window[max(0, self.position - first):size].view(np.uint8))
      self.position = first + size

  def _copy_into(self, part: np.ndarray, box, index, offset: int, piece: np.ndarray) -> None:
    """Copies what the box `index` appended at `offset` holds of the window `box` into `part` (the window's
    values), through `piece`, in one read: the overlap is one run of the box, since the window is one of the
    tensor."""
    lo = [max(w.start, b.start) for w, b in zip(box, index)]
    hi = [min(w.stop, b.stop) for w, b in zip(box, index)]
    if any(a >= b for a, b in zip(lo, hi)):
      return
    first, size = run_of(tuple(slice(a - b.start, c - b.start) for a, c, b in zip(lo, hi, index)),
                         tuple(b.stop - b.start for b in index))
    got = os.preadv(self._file.fileno(), [piece[:size].view(np.uint8)], offset + first * self.dtype.itemsize)
    if got != size * self.dtype.itemsize:
      raise OSError(f"the scratch file of a tensor being hashed gave {got} of {size * self.dtype.itemsize} bytes")
    part[tuple(slice(a - w.start, c - w.start) for a, c, w in zip(lo, hi, box))] = piece[:size].reshape(
        tuple(c - a for a, c in zip(lo, hi)))

  def discard(self) -> None:
    """Gives the buffer or the scratch file back."""
    if self.assembling:
      self._room.give(self._buffer, self._file)
    self._buffer, self._file, self._boxes = None, None, []


class _Room:
  """The buffers and scratch files that tensors out of C order are assembled in, used again once given back: a
  buffer where `memory` bytes hold it beside the others (`held_bytes`: every buffer, in use or not), else a scratch
  file in `scratch_dir` (`scratch`; else neither). `wait()` waits for the tensors being hashed, which give theirs
  back."""

  def __init__(self, scratch_dir: str | None = None, memory: int = 0, wait: Callable[[], None] = lambda: None,
               scratch: bool = True):
    self.scratch_dir, self.memory, self.wait, self.scratch = scratch_dir, memory, wait, scratch
    self.held_bytes = 0
    self._lock = threading.Lock()
    self._buffers: list[np.ndarray] = []  # given back
    self._files: list = []  # given back

  def take(self, nbytes: int):
    """(buffer of `nbytes`, None) or (None, scratch file): a buffer given back if one is large enough (once the
    tensors being hashed have given theirs back), else a new one where the room holds it."""
    self.wait()
    if nbytes <= self.memory:
      with self._lock:
        fits = [b for b in self._buffers if b.nbytes >= nbytes]
        if fits:
          buffer = min(fits, key=lambda b: b.nbytes)
          self._buffers.remove(buffer)
          return buffer[:nbytes], None
        while self._buffers and self.held_bytes + nbytes > self.memory:  # too small ones go
          self.held_bytes -= self._buffers.pop().nbytes
        if self.held_bytes + nbytes <= self.memory:
          self.held_bytes += nbytes
          return np.empty(nbytes, np.uint8), None
    if not self.scratch:
      return None, None
    with self._lock:
      if self._files:
        return None, self._files.pop()
    return None, tempfile.TemporaryFile(dir=self.scratch_dir)  # pylint: disable=consider-using-with

  def give(self, buffer, file) -> None:
    with self._lock:
      if buffer is not None:
        self._buffers.append(buffer.base if buffer.base is not None else buffer)
      if file is not None:
        self._files.append(file)

  def close(self) -> None:
    """Lets every buffer and scratch file go."""
    with self._lock:
      for file in self._files:
        file.close()
      self._buffers, self._files, self.held_bytes = [], [], 0


class Digests:
  """Every tensor one writer hashes: `track` one, `add` its boxes, then `found` (see the module)."""

  def __init__(self, scratch_dir: str | None = None, counted: Callable[[str], bool] = lambda name: False,
               background: bool = True, scratch: bool = True):
    self._counted, self._scratch = counted, scratch
    self._hashes: dict[str, ArrayHash] = {}
    self._done: dict[str, concurrent.futures.Future] = {}
    self._lock = threading.Lock()
    self._rooms: dict[int, _Room] = {}
    self._scratch_dir = scratch_dir
    self._boxes = self._gather = None
    if background:
      self._boxes = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hash-boxes")
      self._gather = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hash-gather")

  @property
  def held_bytes(self) -> int:
    """What the buffers of tensors out of C order hold (in use or kept for the next)."""
    return sum(room.held_bytes for room in self._rooms.values())

  def track(self, name: str, shape, dtype, memory: int = 0) -> None:
    """Hashes tensor `name` of `shape` and `dtype` as it is written (by this writer alone, every element); out of C
    order, it is assembled in a buffer where `memory` bytes hold one beside the others, else in a scratch file."""
    if memory not in self._rooms:  # one pool per budget (each array's plan gives its own; most share one)
      self._rooms[memory] = _Room(self._scratch_dir, memory, self._wait, self._scratch)
    self._hashes[name] = ArrayHash(shape, dtype, self._counted(name), self._rooms[memory])
    if self._hashes[name].complete:  # an empty tensor
      self._finish(name)

  def tracks(self, name: str) -> bool:
    return name in self._hashes

  def tensor(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of the tracked tensor `name`."""
    return self._hashes[name].shape, self._hashes[name].dtype

  def add(self, name: str, index: tuple[slice, ...] | None, value) -> concurrent.futures.Future | None:
    """Adds a box of tensor `name` (`ArrayHash.add`; `value` may be a function that gives it, called by the
    hashing thread); returns the future of that work in the background (None: done)."""
    if self._boxes is None:
      self._add(name, index, value)
      return None
    return self._boxes.submit(self._add, name, index, value)

  def _add(self, name: str, index, value) -> None:
    digest = self._hashes[name]
    digest.add(index, value() if callable(value) else value)
    if digest.complete:
      self._finish(name)

  def _finish(self, name: str) -> None:
    with self._lock:
      if self._gather is None:
        future = concurrent.futures.Future()
        future.set_result(self._hashes[name].hexdigest())
      else:
        future = self._gather.submit(self._hashes[name].hexdigest)
      self._done[name] = future

  def _wait(self) -> None:
    """Waits for the tensors being hashed (they give their buffers back)."""
    with self._lock:
      hashing = list(self._done.values())
    concurrent.futures.wait(hashing)

  def found(self) -> dict[str, list]:
    """name -> [sha256, zero, NaN, inf] of every tracked tensor that is complete and was not dropped (the counts of
    a scale tensor; 0 else), once the work in the background is done."""
    self.close()
    out = {}
    for name, future in self._done.items():
      digest = self._hashes[name]
      if future.result() is not None:
        out[name] = [future.result(), *(digest.counts or [0, 0, 0])]
    return out

  def close(self, cancel: bool = False) -> None:
    """Waits for (or, `cancel`, drops) the work in the background; lets the buffers and scratch files go."""
    for pool in (self._boxes, self._gather):
      if pool is not None:
        pool.shutdown(wait=True, cancel_futures=cancel)
    if cancel:
      for digest in self._hashes.values():
        digest.discard()
    for room in self._rooms.values():
      room.close()
