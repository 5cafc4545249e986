"""`--layout deepseek-fp8`: the BF16 / F32 tensors (embeddings, head, norms, router, eh_proj, the gate bias),
converted by blocks of rows.

A leaf from a chunked source is read in boxes of whole source chunks along its layer axis (or, without one, the
axis its HF rows come from: rows of an embedding or norm, columns of a 2-D Linear kernel): each box is read once and
converted in memory, so no source chunk is decoded again for the next layer or the next block of rows (a smallest
box, when no box fits beside its decoded chunks, is read by layers or rows through a chunk cache holding them). Without a
known chunking (in-memory arrays) each layer's slice, then each block of rows, is read as it is converted.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import ml_dtypes
import numpy as np

from inspect_tool.hf import names as hf_names
from inspect_tool.hf.names import BF16_LINEAR, F32, F32_LINEAR
from inspect_tool.streaming import read_plan


def _rows_by_columns(shape: Sequence[int], rule: hf_names.Rule) -> bool:
  """Whether a BF16_LINEAR (F32_LINEAR) tensor's HF rows are its kernel's columns (a 2-D kernel without rope
  columns)."""
  return rule.kind in (BF16_LINEAR, F32_LINEAR) and len(shape) == 2 and rule.n_in == 1 and not rule.rope


def _row_blocks(value, rule: hf_names.Rule, cfg) -> tuple[tuple[int, ...], Callable[[int, int], Any]]:
  """(HF shape, rows(start, stop) -> those HF rows converted) of a BF16, BF16_LINEAR or F32 tensor.

  Elementwise tensors and 2-D Linear kernels without rope columns are read by rows (kernel columns), so a
  129280 x 7168 embedding or head never sits whole in memory; other BF16 Linears (small) come as one block.
  """
  dtype = np.float32 if rule.kind in (F32, F32_LINEAR) else ml_dtypes.bfloat16
  shape = tuple(int(d) for d in value.shape)
  if rule.kind in (BF16_LINEAR, F32_LINEAR):
    if _rows_by_columns(shape, rule):
      return (shape[1], shape[0]), lambda a, b: cast(np.asarray(value[:, a:b], np.float32).T, dtype)
    matrix = cast(hf_names.hf_matrix(value, rule, cfg), dtype)
    return matrix.shape, lambda a, b: matrix[a:b]
  if not shape:
    return shape, lambda a, b: cast(np.asarray(value, np.float32), dtype)
  return shape, lambda a, b: cast(np.asarray(value[a:b], np.float32), dtype)


def cast(array, dtype):
  """`array` as a C-contiguous array of `dtype` (through float32)."""
  return np.ascontiguousarray(np.asarray(array, np.float32).astype(dtype))


def write_rows(writer, value, rule: hf_names.Rule, layer: int | None, cfg, block_bytes: int, *,
               regions: list | None = None, hf_shape: Sequence[int] | None = None) -> list:
  """Writes the BF16 / F32 tensor(s) of one layer's slice (or a top-level tensor), `block_bytes` of rows at once;
  with `regions` (and the whole tensor's `hf_shape` when placing them), the next rows of tensors already placed.
  Returns the regions."""
  shape, rows = _row_blocks(value, rule, cfg)
  if regions is None:
    regions = [writer.reserve(n.replace("{i}", str(layer)),
                              np.float32 if rule.kind in (F32, F32_LINEAR) else ml_dtypes.bfloat16,
                              tuple(hf_shape) if hf_shape is not None else shape)
               for n in rule.names]  # copies (MTP embed_tokens / shared_head) get every block
  n_rows = shape[0] if shape else 1
  step = max(1, block_bytes // max(4 * math.prod(shape[1:]), 1))
  for start in range(0, n_rows, step):
    block = rows(start, min(start + step, n_rows))
    for region in regions:
      region.write(block)
  return regions


def slices(value, entry: hf_names.Entry) -> Iterator[tuple[int | None, Any]]:
  """(HF layer, per-layer slice) of a leaf; indexing only, so lazy arrays read one layer at a time."""
  if entry.layer_axis is None:
    yield (entry.layers[0] if entry.layers else None), value
    return
  for s, layer in enumerate(entry.layers):
    yield layer, value[(slice(None),) * entry.layer_axis + (s,)]


def read_axis(entry: hf_names.Entry) -> int | None:
  """The axis a BF16 / F32 leaf is read along in boxes: its layer axis, else its HF rows' axis (None: whole)."""
  if entry.layer_axis is not None:
    return entry.layer_axis
  if _rows_by_columns(entry.shape, entry.rule):
    return 1
  return 0 if entry.rule.kind not in (BF16_LINEAR, F32_LINEAR) and entry.shape else None


def write_leaf(writer, value, entry: hf_names.Entry, cfg, block_bytes: int, chunk: Sequence[int] | None = None,
               available: int = 0, overhead: Callable[[Sequence[int]], int] = lambda box: 0) -> None:
  """Writes every BF16 / F32 tensor of a leaf. With the source's `chunk` shape: in boxes of whole chunks along the
  layer axis (or the HF row axis), as large as `available` bytes hold with their decode `overhead(box)`, each
  read once (`read_plan.plan_boxes`; where no whole chunk fits, streamed from a one-chunk array, or a smallest box
  of a lazy source view read through a chunk cache, by layer or rows: `read.ArrayView.stream`, `.cached`); else
  layer by layer."""
  shape = tuple(int(d) for d in value.shape)
  if chunk is None or not shape:
    for layer, part in slices(value, entry):
      write_rows(writer, part, entry.rule, layer, cfg, block_bytes)
    return
  axis, cached, streamed = read_axis(entry), False, False
  if axis is not None:
    box, _, cached, streamed = read_plan.plan_boxes(shape, 4, chunk, available, (axis,), overhead,
                                                    cached=value.cached_reads, stream=value.stream_overhead)
  else:
    box = shape
  regions = None
  hf_shape = None if axis is None else (shape[1], shape[0]) if _rows_by_columns(shape, entry.rule) else shape
  for index in read_plan.boxes(shape, box):
    block = value.stream(index) if streamed else value.cached(index) if cached else np.asarray(value[index])
    if entry.layer_axis is None:
      regions = write_rows(writer, block, entry.rule, entry.layers[0] if entry.layers else None, cfg, block_bytes,
                           regions=regions, hf_shape=hf_shape)
      continue
    for s in range(index[axis].start, index[axis].stop):
      part = block[(slice(None),) * axis + (s - index[axis].start,)]
      write_rows(writer, part, entry.rule, entry.layers[s], cfg, block_bytes)
    del block
