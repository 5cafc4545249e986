"""Bytes an array takes in TPU memory: XLA lays each array out in tiles of 128 lanes by 8 rows (smaller tiles of 4,
2 or 1 rows for fewer rows; 16-bit types pack two rows per 32-bit word, so their smallest tile is 2 rows), and for
an entry array it picks which two dimensions are the minor ones so that the padding is least.

`padded_bytes(shape, itemsize)` (an entry array: the state): over every ordered pair (minor m, second-minor s) of
dimensions, the shape with m rounded up to 128 and s up to its tile rows (a power of two below 8, else a multiple of
8), the others as they are; the least of these. A 1-D array is tiled by the power of two from 128 to 1024 elements
that covers it; no array takes less than 512 bytes. Checked against the sizes of every parameter in XLA's buffer
assignments of MaxText's step on v5p (`tests/test_tpu_layout.py`) and against its `argument_size_in_bytes` on every
grid point (`tests/test_xla_grid.py`: deepseek3-tiny's 64-wide dimensions pad to 128, so its training state takes
1.39 × its elements' bytes). `default_bytes`: a temporary in the row-major layout XLA gives most of them (the last
dimension minor: yarn's float32[163840, 32] RoPE table takes 80 MiB, not 20).
"""

from __future__ import annotations

import itertools
import math

LANES = 128
ROW_ELEMENTS = 8  # rows per tile (16-bit types pack two rows per 32-bit word)
LINEAR_TILE = 1024  # the largest tile of a 1-D array
GRANULE = 512  # the least bytes an array takes


def _rows(size: int, itemsize: int) -> int:
  if size >= ROW_ELEMENTS:
    return -(-size // ROW_ELEMENTS) * ROW_ELEMENTS
  rows = max(1, 4 // itemsize)  # the smallest tile: one 32-bit word's rows
  while rows < size:
    rows *= 2
  return rows


def default_bytes(shape, itemsize: int) -> int:
  """Bytes of a temporary XLA lays out row-major: the last dimension minor (128 lanes), the one before it in rows."""
  dims = [int(d) for d in shape]
  if len(dims) <= 1:
    return padded_bytes(dims, itemsize)
  rest = math.prod(dims[:-2])
  return max(GRANULE, -(-dims[-1] // LANES) * LANES * _rows(dims[-2], itemsize) * rest * itemsize)


def padded_bytes(shape, itemsize: int) -> int:
  """Bytes of an array of `shape` and `itemsize` in TPU memory (see the module docstring)."""
  dims = [int(d) for d in shape]
  if len(dims) <= 1:
    n = dims[0] if dims else 1
    tile = LANES
    while tile < min(n, LINEAR_TILE):
      tile *= 2
    return max(GRANULE, -(-n // tile) * tile * itemsize)
  best = None
  for minor, second in itertools.permutations(range(len(dims)), 2):
    rest = math.prod(d for i, d in enumerate(dims) if i not in (minor, second))
    size = -(-dims[minor] // LANES) * LANES * _rows(dims[second], itemsize) * rest * itemsize
    best = size if best is None else min(best, size)
  return max(GRANULE, best)
