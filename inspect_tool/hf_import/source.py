"""Import stage 2, reading: a Hugging Face DeepSeek directory as the source arrays of MaxText's leaves.

`HfSource` is an array source as the export's are (`streaming.source.ArraySource`), so the export's writer cuts,
reads and writes every MaxText array by slices within `--max-memory`. A MaxText leaf is assembled from the
release's tensors through the one name mapping (`hf.names.leaf_plan`, read backwards by
`hf.restore.read_block`): a stacked array from one HF tensor per layer (per expert for the routed
experts), each read when a slice needs it. The "chunk" a slice is aligned to is what one read holds: one layer
(and one expert) of a stack; a band of rows of the embedding and the output head, which are read row range by row
range from the shard. FP8 weights are dequantized exactly: value × the `weight_scale_inv` of its 128×128 block.
"""

from __future__ import annotations

import concurrent.futures
import math

import numpy as np

from inspect_tool import errors
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import names_v4 as hf_names_v4
from inspect_tool.hf import restore as hf_restore
from inspect_tool.output import stop
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths
from inspect_tool.streaming import source as source_lib

ROW_BAND_BYTES = 64 * 2**20  # float32 bytes of the rows one read of the embedding or head holds
COPIES = 3  # float32 buffers one HF tensor may be held in at once (raw, float32, MaxText layout)


class _Pending:
  """A slice read in the background thread; `result()` waits for it (its error raised as it is)."""

  def __init__(self, future):
    self._future = future

  def result(self) -> np.ndarray:
    return self._future.result()


class HfSource(source_lib.ArraySource):
  """The MaxText leaves `leaves` of `cfg`'s model, read from the Hugging Face directory `path`."""

  def __init__(self, path: str, cfg, leaves):
    self.path = path
    self.items_dir = paths.absolute(path)  # named in error lines, as the export's sources do
    self._cfg = cfg
    self._tensors = hf_restore.Tensors(path)
    self._tensors.check_format()
    plan = hf_names_v4.plan(cfg, self._tensors.table)
    problems, self.known_names = hf_restore.check(self._tensors, plan, cfg)
    if problems:
      more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
      raise errors.MismatchError(f"Hugging Face checkpoint {path} does not fit the model: {problems[0].text}{more}")
    self._entries, self._leaves = {}, {}
    for leaf, target in hf_restore.planned(leaves, plan):
      if target is None:
        raise errors.MismatchError(f"model weight {leaf.dotted} has no Hugging Face DeepSeek tensor")
      entry = plan[target]
      if tuple(leaf.shape) != entry.shape:
        raise errors.MismatchError(f"model weight {leaf.dotted} is {leaf.shape}; the plan has {entry.shape}")
      self._entries[leaf.key], self._leaves[leaf.key] = entry, leaf
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-read")

  @property
  def tensors(self) -> hf_restore.Tensors:
    return self._tensors

  def entry(self, key: tuple[str, ...]) -> hf_names.Entry:
    return self._entries[key]

  def source_names(self, key: tuple[str, ...]) -> list[str]:
    """The HF tensors the leaf `key` is read from (`{i}` and `{j}` filled in; scales of FP8 ones included)."""
    entry = self._entries[key]
    names = []
    for layer in (entry.layers or (None,)) if entry.rule.names else ():
      name = entry.rule.names[0].replace("{i}", str(layer))
      experts = range(_layer_shape(entry)[0]) if "{j}" in name else (None,)
      for j in experts:
        one = name.replace("{j}", str(j))
        names.append(one)
        scale = self._tensors.scale_name(one) if one in self._tensors else None
        if scale:
          names.append(scale)
    return names

  def unused_names(self) -> list[str]:
    """Tensors of the directory that no leaf reads and the mapping does not account for."""
    return sorted(set(self._tensors.table) - set(self.known_names))

  # The reading interface of `streaming.read`'s sources -------------------------------------------------

  def leaf(self, key: tuple[str, ...]) -> tree.Leaf:
    return self._leaves[key]

  def keys(self):
    return list(self._entries)

  def open(self, key: tuple[str, ...]):
    return key

  def chunk_shape(self, key) -> tuple[int, ...]:
    """What one read holds: one layer (one expert) of a stack; a band of rows of a 2-D top-level tensor."""
    entry = self._entries[key]
    shape = list(entry.shape)
    if entry.rule.kind == hf_names.EXPERTS_FP8:  # one expert (of one layer): an unscanned layer's too
      shape[1 if entry.layer_axis == 0 else 0] = 1
    if entry.layer_axis is not None:
      shape[entry.layer_axis] = 1
    elif _row_axis(entry) is not None:
      axis = _row_axis(entry)
      other = math.prod(shape) // shape[axis]
      shape[axis] = max(1, min(shape[axis], ROW_BAND_BYTES // (4 * other)))
    return tuple(shape)

  def chunk_bytes(self, key) -> int:
    return COPIES * 4 * math.prod(self.chunk_shape(key))

  def read_overhead(self, key, box) -> int:  # pylint: disable=unused-argument
    """Bytes held beyond a box while it is read: one HF tensor (or band of rows) at a time, in `COPIES`."""
    return self.chunk_bytes(key)

  def stored_layout(self, key) -> None:  # pylint: disable=unused-argument
    return None  # HF tensors are always converted, never copied as stored

  def read(self, key, index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` of the leaf `key`, at the leaf's dtype."""
    entry, dtype = self._entries[key], np.dtype(self._leaves[key].dtype)
    index = tuple(index) + (slice(None),) * (len(entry.shape) - len(index))
    axis = _row_axis(entry) if entry.layer_axis is None else None
    if axis is not None:
      value = _read_rows(self._tensors, entry, index, axis)
    else:
      value = hf_restore.read_block(self._tensors, entry, index, self._cfg)
    return np.ascontiguousarray(value, dtype=dtype)

  def read_async(self, key, index: tuple[slice, ...]) -> _Pending:
    return _Pending(self._pool.submit(self.read, key, index))

  def close(self) -> None:
    """Ends the reading thread (after a stop signal without waiting for its read: it may never end)."""
    self._pool.shutdown(wait=stop.received() is None, cancel_futures=True)

  def __contains__(self, key) -> bool:
    return key in self._entries

  def __len__(self) -> int:
    return len(self._entries)


def _layer_shape(entry) -> tuple[int, ...]:
  if entry.layer_axis is None:
    return entry.shape
  return entry.shape[:entry.layer_axis] + entry.shape[entry.layer_axis + 1:]


def _row_axis(entry) -> int | None:
  """The MaxText axis that runs along the HF rows of a 2-D top-level bf16 tensor (embedding: 0, head: 1)."""
  if len(entry.shape) != 2 or entry.layers:
    return None
  return {hf_names.BF16: 0, hf_names.BF16_LINEAR: 1}.get(entry.rule.kind)


def _read_rows(tensors: hf_restore.Tensors, entry, index: tuple[slice, slice], axis: int) -> np.ndarray:
  """Rows `index[axis]` of the HF tensor (MaxText's layout: transposed for the head), read from the shard alone."""
  name = entry.rule.names[0]
  rows = index[axis].indices(entry.shape[axis])
  start, stop = rows[0], rows[1]
  value = tensors.read_rows(name, start, stop)
  return value[:, index[1]] if axis == 0 else value.T[index[0], :]
