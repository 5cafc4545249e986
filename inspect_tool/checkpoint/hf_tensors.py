"""The tensors of a Hugging Face safetensors directory, read by name: float ones as float32, float8 ones
dequantized as DeepSeek's FP8 release defines them (value × `weight_scale_inv` of its block, 128×128 unless
`config.json`'s `quantization_config.weight_block_size` says otherwise; the block grid rounded up at the edges).

Tensor data is read from the shards at the offsets their validated headers give (safetensors 0.8's own numpy
reader has no float8 dtype). A float8 weight is refused in one line naming it when one of its bytes is NaN or
inf (e4m3fn: 0x7f, 0xff), or when its `weight_scale_inv` (small: one value per block) has another grid than the
weight's blocks or a value that is not finite, not positive or over `MAX_SCALE_INV` (a weight that large
squared overflows float32): such a checkpoint would load and give `loss nan` or a zero model.
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
from inspect_tool.host import memory as host_memory
from inspect_tool.storage import paths
from inspect_tool.storage import remote
from inspect_tool.storage import web

CONFIG_NAME = "config.json"
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"
CHECKED_BYTES = 64 << 20  # reads at least this large are checked against the memory available first
MAX_SCALE_INV = 2.0**55  # (448 × 2^55)^2 < float32's largest value: a dequantized weight's square stays finite


def block_size(path: str) -> tuple[int, int]:
  """`quantization_config.weight_block_size` of `config.json` (DeepSeek's [128, 128] when absent)."""
  raw = files.read_bytes(paths.join(path, CONFIG_NAME), 1 << 20, "Hugging Face config")
  doc = files.parse_json(raw, lambda why: errors.CheckpointError(f"{path}/{CONFIG_NAME}: {why}"))
  quantization = doc.get("quantization_config") if isinstance(doc, dict) else None
  if quantization is not None and not isinstance(quantization, dict):
    shown = repr(quantization) if not isinstance(quantization, list) else "list"
    raise errors.CheckpointError(f"{path}/{CONFIG_NAME}: quantization_config is {shown[:40]}; expected an object or "
                                 "null")
  block = (quantization or {}).get("weight_block_size")
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
    self.block = block_size(path) if files.kind(paths.join(path, CONFIG_NAME)) == "file" else hf_names.BLOCK

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
    _check_fits(file, name, entry["shape"], count * (dtype.itemsize + 4))
    data = read_span(file, name, entry["start"], count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
      raise errors.CheckpointError(f"{file}: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype).reshape(entry["shape"])

  def read(self, name: str) -> np.ndarray:
    """`name` as float32; a float8 weight times its `<name>_scale_inv` per block."""
    value = self._raw(name)
    if self.dtype(name) not in FP8:
      return value.astype(np.float32)
    scale_name = name + SCALE_SUFFIX
    scale = self._raw(scale_name)
    where = f"{self.table[name][0]}: tensor {name!r}"
    check_fp8(value, where)
    check_scale(scale, scale_shape(value.shape, self.block), f"{self.table[scale_name][0]}: tensor {scale_name!r}")
    return dequantize(value, scale, self.block)

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of `name` as float32, reading only their bytes (a float8 weight: whole, then cut)."""
    file, entry = self.table[name]
    if entry["dtype"] in FP8 or not entry["shape"]:
      return self.read(name)[start:stop]
    dtype = np.dtype(FLOATS[entry["dtype"]])
    row = math.prod(entry["shape"][1:]) * dtype.itemsize
    _check_fits(file, name, entry["shape"], (stop - start) * row // dtype.itemsize * (dtype.itemsize + 4))
    data = read_span(file, name, entry["start"] + start * row, (stop - start) * row)
    if len(data) != (stop - start) * row:
      raise errors.CheckpointError(f"{file}: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype).reshape((stop - start,) + tuple(entry["shape"][1:])).astype(np.float32)


def read_span(file: str, name: str, start: int, count: int) -> bytes:
  """`count` bytes of `file` from offset `start` (a gs:// object or a URL: one ranged read) for tensor `name`."""
  if paths.is_remote(file):
    return remote.read_range(file, start, count) if count else b""
  if paths.is_web(file):
    return web.read_range(file, start, count)
  try:
    with open(file, "rb") as f:
      f.seek(start)
      return f.read(count)
  except OSError as e:
    raise errors.CheckpointError(f"cannot read {file} (tensor {name!r}): {e.strerror or e}") from None


def _check_fits(file: str, name: str, shape, needed: int) -> None:
  """Refuses to read a tensor whose bytes and float32 copy (`needed`) would not fit in the memory available,
  before any allocation (a header may claim terabytes of a sparse file). Reads under `CHECKED_BYTES` are not
  checked (a release has ~100,000 small tensors; the memory figures are read from /proc each time)."""
  if needed < CHECKED_BYTES:
    return
  available, source = host_memory.available_memory()
  if available is not None and os.environ.get(host_memory.SKIP_ENV) != "1" and needed > available:
    raise errors.CheckpointError(f"{file}: tensor {name!r} {list(shape)} needs {needed / 2**30:.1f} GiB to read; "
                                 f"available {available / 2**30:.1f} GiB ({source})")


def dequantize(qvalue: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = hf_names.BLOCK) -> np.ndarray:
  """float32 of an (out, in) float8 weight whose block (r, c) is scaled by scale_inv[r, c] (the scale grid as
  `scale_shape` gives it: then no intermediate is larger than twice the weight, whatever the block size)."""
  rows, cols = qvalue.shape
  scale = np.repeat(np.asarray(scale_inv, np.float32), min(block[0], rows), axis=0)[:rows]
  full = np.repeat(scale, min(block[1], cols), axis=1)[:, :cols]
  return qvalue.astype(np.float32) * full


def check_fp8(qvalue: np.ndarray, where: str) -> None:
  """Refuses float8 data holding NaN or inf bytes (e4m3fn: 0x7f and 0xff are NaN; e5m2: exponent all ones)."""
  raw = np.ascontiguousarray(qvalue).view(np.uint8)
  if qvalue.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
    bad = np.flatnonzero((raw & 0x7F) == 0x7F)
  else:
    bad = np.flatnonzero((raw & 0x7C) == 0x7C)
  if bad.size:
    raise errors.CheckpointError(f"{where} holds {bad.size} NaN or inf float8 value(s) (first at flat index "
                                 f"{int(bad[0])}, byte {int(raw.reshape(-1)[bad[0]]):#04x}); accepted: finite values")


def check_scale(scale: np.ndarray, grid: tuple[int, int], where: str) -> None:
  """Refuses a `weight_scale_inv` of another shape than the weight's block grid, or with a value that is not
  finite, not positive or over `MAX_SCALE_INV`."""
  if tuple(scale.shape) != tuple(grid):
    raise errors.CheckpointError(f"{where} has shape {list(scale.shape)}; the weight's blocks need {list(grid)}")
  values = np.asarray(scale, np.float64)
  bad = ~(np.isfinite(values) & (values > 0) & (values <= MAX_SCALE_INV))
  if bad.any():
    index = np.unravel_index(int(np.argmax(bad)), values.shape)
    raise errors.CheckpointError(
        f"{where} holds {int(bad.sum())} bad scale(s), e.g. {float(values[index])!r} at {list(map(int, index))}; "
        f"accepted: finite scales in (0, {MAX_SCALE_INV:.3g}]")


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  """The `weight_scale_inv` grid of an (out, in) weight: one per block, rounded up at the edges."""
  return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
