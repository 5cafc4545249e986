"""The tensors of a Hugging Face safetensors directory, read by name: float ones as float32, float8 ones
dequantized as DeepSeek's FP8 release defines them (value × `weight_scale_inv` of its block, 128×128 unless
`config.json`'s `quantization_config.weight_block_size` says otherwise; the block grid rounded up at the edges).

Tensor data is read from the shards at the offsets their validated headers give (safetensors 0.8's own numpy
reader has no float8 dtype).
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.checkpoint import hf_names
from inspect_tool.checkpoint import safetensors_header

CONFIG_NAME = "config.json"
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"


def block_size(path: str) -> tuple[int, int]:
  """`quantization_config.weight_block_size` of `config.json` (DeepSeek's [128, 128] when absent)."""
  raw = files.read_bytes(os.path.join(path, CONFIG_NAME), 1 << 20, "Hugging Face config")
  doc = files.parse_json(raw, lambda why: errors.CheckpointError(f"{path}/{CONFIG_NAME}: {why}"))
  block = (doc.get("quantization_config") or {}).get("weight_block_size") if isinstance(doc, dict) else None
  if block is None:
    return hf_names.BLOCK
  if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
    raise errors.CheckpointError(f"{path}/{CONFIG_NAME}: weight_block_size {str(block)[:40]} is not two positive "
                                 "integers")
  return tuple(block)


class Tensors:
  """The tensors of a safetensors directory, read by name as float32 (float8 ones dequantized)."""

  def __init__(self, path: str):
    self.path = path
    self.table = safetensors_header.read_tensor_table(path)
    self.block = block_size(path) if files.kind(os.path.join(path, CONFIG_NAME)) == "file" else hf_names.BLOCK

  def __contains__(self, name: str) -> bool:
    return name in self.table

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.table[name][1]["shape"])

  def dtype(self, name: str) -> str:
    return self.table[name][1]["dtype"]

  def _raw(self, name: str) -> np.ndarray:
    file, entry = self.table[name]
    dtype = np.dtype(FP8.get(entry["dtype"]) or FLOATS[entry["dtype"]])
    count = math.prod(entry["shape"])
    try:
      with open(file, "rb") as f:
        f.seek(entry["start"])
        data = f.read(count * dtype.itemsize)
    except OSError as e:
      raise errors.CheckpointError(f"cannot read {file}: {e.strerror or e}") from None
    if len(data) != count * dtype.itemsize:
      raise errors.CheckpointError(f"{file}: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype).reshape(entry["shape"])

  def read(self, name: str) -> np.ndarray:
    """`name` as float32; a float8 weight times its `<name>_scale_inv` per block."""
    value = self._raw(name)
    if self.dtype(name) not in FP8:
      return value.astype(np.float32)
    return dequantize(value, self._raw(name + SCALE_SUFFIX), self.block)

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of `name` as float32, reading only their bytes (a float8 weight: whole, then cut)."""
    file, entry = self.table[name]
    if entry["dtype"] in FP8 or not entry["shape"]:
      return self.read(name)[start:stop]
    dtype = np.dtype(FLOATS[entry["dtype"]])
    row = math.prod(entry["shape"][1:]) * dtype.itemsize
    try:
      with open(file, "rb") as f:
        f.seek(entry["start"] + start * row)
        data = f.read((stop - start) * row)
    except OSError as e:
      raise errors.CheckpointError(f"cannot read {file}: {e.strerror or e}") from None
    if len(data) != (stop - start) * row:
      raise errors.CheckpointError(f"{file}: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype).reshape((stop - start,) + tuple(entry["shape"][1:])).astype(np.float32)


def dequantize(qvalue: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = hf_names.BLOCK) -> np.ndarray:
  """float32 of an (out, in) float8 weight whose block (r, c) is scaled by scale_inv[r, c]."""
  rows = np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0)[:qvalue.shape[0]]
  full = np.repeat(rows, block[1], axis=1)[:, :qvalue.shape[1]]
  return qvalue.astype(np.float32) * full


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  """The `weight_scale_inv` grid of an (out, in) weight: one per block, rounded up at the edges."""
  return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
