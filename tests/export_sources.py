"""Float source checkpoints for export tests and benchmarks, written slice by slice (never a whole array in memory).

Each array gets seeded normal values (scale 1/sqrt(fan-in); norms ones, biases zeros) and is stored chunked along
its first axis in blocks of at most `chunk_bytes`, as a checkpoint written by many devices is chunked by shards.
"""

from __future__ import annotations

import math
import os

import numpy as np

from inspect_tool.configuration import config
from inspect_tool.paramtree import tree
from inspect_tool.paramtree import params
from inspect_tool.streaming import orbax_writer


def write_source(step_dir: str, tokens: list[str], *, chunk_bytes: int = 16 << 20, seed: int = 0) -> tuple[int, int]:
  """Writes the float model of `tokens` as an Orbax checkpoint (converter layout) at `step_dir`.

  Returns (total bytes, largest array bytes).
  """
  rng = np.random.default_rng(seed)
  items = os.path.join(step_dir, "items")
  os.makedirs(items, exist_ok=True)
  writer = orbax_writer.OrbaxArrayWriter(items)
  total = largest = 0
  for leaf in params.model_leaves(config.resolve_config(tokens)):
    shape = tuple(leaf.shape)
    nbytes = math.prod(shape) * 4
    row = nbytes // max(shape[0], 1) if shape else 4
    rows = max(1, min(shape[0], chunk_bytes // max(row, 1))) if shape else 1
    block = (rows,) + shape[1:] if shape else ()
    key = tree.param_key(leaf.module_path)  # converter layout: gate bias under params/params too
    store = writer.create(key, shape, np.float32, block)
    fan_in = shape[0] if len(shape) > 1 else 1
    for start in range(0, shape[0] if shape else 1, rows):
      part = (min(rows, shape[0] - start),) + shape[1:] if shape else ()
      if leaf.key[-1] == "scale":
        value = np.ones(part, np.float32)
      elif leaf.key[-1] == "bias":
        value = np.zeros(part, np.float32)
      else:
        value = rng.standard_normal(part, dtype=np.float32)
        value *= np.float32(1.0 / np.sqrt(fan_in))
      writer.write(store, (slice(start, start + part[0]),) if shape else (), value)
      del value
    total += nbytes
    largest = max(largest, nbytes)
  writer.finalize(step_dir, "items")
  return total, largest
