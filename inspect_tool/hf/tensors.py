"""The tensors of a Hugging Face safetensors directory, read by name as float32: float ones as they are, quantized
ones dequantized as DeepSeek's releases define them.

* FP8 (DeepSeek-V3, V3.1, V4): float8_e4m3fn values times the scale of their block, 128×128 unless `config.json`'s
  `quantization_config.weight_block_size` says otherwise (the block grid rounded up at the edges). The scale is
  `<name>_scale_inv` (V3) or, for `<x>.weight`, `<x>.scale` (V4's release); float32, or float8_e8m0fnu (a power of
  two per byte) when `quantization_config.scale_fmt` is `ue8m0`. With `scale_fmt: ue8m0` (V3.1, V4) every float32
  scale must be a power of two: servers that run ue8m0 kernels round a scale up to one without requantizing.
* FP4 (DeepSeek-V4's routed experts, `expert_dtype: fp4`): int8 bytes holding two e2m1 values each (low nibble
  first) and one float8_e8m0fnu scale per 32 values of a row (`quant.microscaling`); the weight's logical shape is
  (rows, 2 × stored columns).
* Integer tensors (V4's hash-routing table `tid2eid`) are read as float32 (MaxText keeps the table in float32).

Tensor data is read from the shards at the offsets their validated headers give (safetensors 0.8's own numpy
reader has no float8 dtype). A quantized weight is refused in one line naming it when one of its bytes is NaN or
inf (e4m3fn: 0x7f, 0xff), when its scale has another grid than the weight's blocks, a value that is not finite, not
positive or over `MAX_SCALE_INV` (a weight that large squared overflows float32), an e8m0 NaN byte (0xff) or a
float32 scale that is not a power of two under `scale_fmt: ue8m0`; a directory whose config.json and tensors
disagree on the format (FP4 bytes without `expert_dtype: fp4`, e8m0 scales without `scale_fmt: ue8m0`) is refused
too: such a checkpoint would load and give `loss nan`, a zero model, or another model on another reader.
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.hf import names as hf_names
from inspect_tool.hf import safetensors_header
from inspect_tool.host import memory as host_memory
from inspect_tool.storage import paths
from inspect_tool.storage import remote
from inspect_tool.storage import web
from quant import microscaling

CONFIG_NAME = "config.json"
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
E8M0 = "F8_E8M0"
FP4_PACKED = {"I8": np.int8, "U8": np.uint8}  # two e2m1 values per byte
INTS = {"I32": np.int32, "I64": np.int64, "I16": np.int16}
RAW = FLOATS | FP8 | FP4_PACKED | INTS | {E8M0: np.uint8}
SCALE_SUFFIX = "_scale_inv"
V4_SCALE_SUFFIX = "scale"  # `<x>.weight` -> `<x>.scale` (DeepSeek-V4's release)
FP4_GROUP = microscaling.FP4_GROUP
CHECKED_BYTES = 64 << 20  # reads at least this large are checked against the memory available first
MAX_SCALE_INV = 2.0**55  # (448 × 2^55)^2 < float32's largest value: a dequantized weight's square stays finite


def quantization(path: str) -> dict:
  """What `config.json` says of the stored format: {"block": (rows, cols) (DeepSeek's [128, 128] when absent),
  "scale_fmt": "ue8m0" or None, "expert_dtype": "fp4", "fp8" or None (top level, or in quantization_config as
  V4.1 writes it)}."""
  raw = files.read_bytes(paths.join(path, CONFIG_NAME), 1 << 20, "Hugging Face config")
  doc = files.parse_json(raw, lambda why: errors.CheckpointError(f"{path}/{CONFIG_NAME}: {why}"))
  doc = doc if isinstance(doc, dict) else {}
  quantization = doc.get("quantization_config")
  if quantization is not None and not isinstance(quantization, dict):
    shown = repr(quantization) if not isinstance(quantization, list) else "list"
    raise errors.CheckpointError(f"{path}/{CONFIG_NAME}: quantization_config is {shown[:40]}; expected an object or "
                                 "null")
  quantization = quantization or {}
  block = quantization.get("weight_block_size")
  if block is None:
    block = hf_names.BLOCK
  elif not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise errors.CheckpointError(f"{path}/{CONFIG_NAME}: weight_block_size {str(block)[:40]} is not two positive "
                                 "integers")
  found = {"block": tuple(block), "scale_fmt": quantization.get("scale_fmt"),
           "expert_dtype": quantization.get("expert_dtype", doc.get("expert_dtype"))}
  for name, accepted in (("scale_fmt", (None, "ue8m0", "float")), ("expert_dtype", (None, "fp4", "fp8"))):
    if found[name] not in accepted:
      raise errors.CheckpointError(f"{path}/{CONFIG_NAME}: {name} {str(found[name])[:40]!r} is not a format DeepSeek "
                                   f"releases use; accepted: {', '.join(a for a in accepted if a)}")
  found["scale_fmt"] = None if found["scale_fmt"] == "float" else found["scale_fmt"]
  return found


class Tensors:
  """The tensors of a safetensors directory, read by name as float32 (quantized ones dequantized)."""

  def __init__(self, path: str):
    self.path = path
    self.table = safetensors_header.read_tensor_table(path)
    has_config = files.kind(paths.join(path, CONFIG_NAME)) == "file"
    self.format = quantization(path) if has_config else {"block": hf_names.BLOCK, "scale_fmt": None,
                                                         "expert_dtype": None}
    self.block = self.format["block"]

  def __contains__(self, name: str) -> bool:
    return name in self.table

  def shape(self, name: str) -> tuple[int, ...]:
    """The stored shape (an FP4 weight's columns are bytes: `logical_shape` gives its values)."""
    return tuple(self.table[name][1]["shape"])

  def dtype(self, name: str) -> str:
    return self.table[name][1]["dtype"]

  def scale_name(self, name: str) -> str | None:
    """The scale tensor stored for a quantized weight `name` (`_scale_inv`, or V4's `.scale`), or None."""
    if name + SCALE_SUFFIX in self.table:
      return name + SCALE_SUFFIX
    if name.endswith(".weight") and name[:-len("weight")] + V4_SCALE_SUFFIX in self.table:
      return name[:-len("weight")] + V4_SCALE_SUFFIX
    return None

  def kind(self, name: str) -> str:
    """"float", "fp8", "fp4" (packed bytes with a scale), "int" or "other"."""
    dtype = self.dtype(name)
    if dtype in FLOATS:
      return "float"
    if dtype in FP8:
      return "fp8"
    if dtype in FP4_PACKED and self.scale_name(name) is not None:
      return "fp4"
    return "int" if dtype in INTS else "other"

  def check_format(self) -> None:
    """Refuses, from the headers alone, a directory whose config.json and tensors disagree on the format: packed
    FP4 weights without `expert_dtype: fp4`, routed experts that are not FP4 with it, e8m0 scales without
    `scale_fmt: ue8m0`."""
    where = f"{paths.join(self.path, CONFIG_NAME)}"
    fp4 = sorted(name for name in self.table if self.kind(name) == "fp4")
    if fp4 and self.format["expert_dtype"] != "fp4":
      raise errors.CheckpointError(f"{self._where(fp4[0])} is packed FP4 ({self.dtype(fp4[0])} beside an e8m0 scale) "
                                   f"but {where} has no expert_dtype fp4 ({len(fp4)} such tensors): config.json and "
                                   "the tensors disagree")
    if self.format["expert_dtype"] == "fp4":
      other = sorted(name for name in self.table if ".experts." in name and name.endswith(".weight")
                     and self.kind(name) != "fp4")
      if other:
        raise errors.CheckpointError(f"{where} says expert_dtype fp4 but routed expert {other[0]} is "
                                     f"{self.dtype(other[0])} ({len(other)} such tensors): config.json and the "
                                     "tensors disagree")
    e8m0 = sorted(name for name in self.table if self.dtype(name) == E8M0)
    if e8m0 and self.format["scale_fmt"] != "ue8m0":
      raise errors.CheckpointError(f"{self._where(e8m0[0])} holds float8_e8m0fnu scales but {where} has no "
                                   "quantization_config.scale_fmt ue8m0: config.json and the tensors disagree")

  def logical_shape(self, name: str) -> tuple[int, ...]:
    """The shape of the values: an FP4 weight holds two per stored byte of its last axis."""
    shape = self.shape(name)
    return shape[:-1] + (2 * shape[-1],) if self.kind(name) == "fp4" and shape else shape

  def _raw(self, name: str) -> np.ndarray:
    file, entry = self.table[name]
    dtype = np.dtype(RAW[entry["dtype"]])
    count = math.prod(entry["shape"])
    _check_fits(file, name, entry["shape"], count * (dtype.itemsize + 4))
    data = read_span(file, name, entry["start"], count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
      raise errors.CheckpointError(f"{file}: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype).reshape(entry["shape"])

  def _where(self, name: str) -> str:
    return f"{self.table[name][0]}: tensor {name!r}"

  def _scale(self, name: str, grid) -> np.ndarray:
    """The float32 scale of `name`'s blocks, checked (grid, values, the format config.json names)."""
    scale_name = self.scale_name(name)
    where = self._where(scale_name)
    raw = self._raw(scale_name)
    if self.dtype(scale_name) == E8M0:
      if self.format["scale_fmt"] != "ue8m0":
        raise errors.CheckpointError(f"{where} holds float8_e8m0fnu scales but {CONFIG_NAME} has no quantization_config"
                                     ".scale_fmt ue8m0: config.json and the tensors disagree")
      if tuple(raw.shape) != tuple(grid):
        raise errors.CheckpointError(f"{where} has shape {list(raw.shape)}; the weight's blocks need {list(grid)}")
      nan = raw == microscaling.E8M0_NAN
      if nan.any():
        raise errors.CheckpointError(f"{where} holds {int(nan.sum())} NaN e8m0 scale(s) (byte 0xff); accepted: "
                                     "bytes 0x00..0xfe")
      return microscaling.e8m0_decode(raw)
    if self.dtype(scale_name) not in FLOATS:
      raise errors.CheckpointError(f"{where} is {self.dtype(scale_name)}; a scale is float32 or float8_e8m0fnu")
    check_scale(raw, grid, where)
    scale = raw.astype(np.float32)
    if self.format["scale_fmt"] == "ue8m0":
      check_power_of_two(scale, where)
    return scale

  def read(self, name: str) -> np.ndarray:
    """`name` as float32: a quantized weight dequantized by its scales, an integer table converted."""
    kind = self.kind(name)
    value = self._raw(name)
    if kind == "float" or kind == "int":
      return value.astype(np.float32)
    where = self._where(name)
    if kind == "fp4":
      if self.format["expert_dtype"] != "fp4":
        raise errors.CheckpointError(f"{where} is packed FP4 ({self.dtype(name)} with a scale) but {CONFIG_NAME} "
                                     "has no expert_dtype fp4: config.json and the tensors disagree")
      rows, cols = value.shape
      return microscaling.fp4_dequantize(value, self._fp4_scale_codes(name, (rows, 2 * cols // FP4_GROUP)))
    if kind != "fp8":
      raise errors.CheckpointError(f"{where} is {self.dtype(name)}, not a tensor this reader decodes")
    if self.scale_name(name) is None:
      raise errors.CheckpointError(f"{where} is {self.dtype(name)} but its scale ({name}{SCALE_SUFFIX} or "
                                   f"{V4_SCALE_SUFFIX}) is missing")
    check_fp8(value, where)
    return dequantize(value, self._scale(name, scale_shape(value.shape, self.block)), self.block)

  def _fp4_scale_codes(self, name: str, grid) -> np.ndarray:
    scale_name = self.scale_name(name)
    where = self._where(scale_name)
    if self.dtype(scale_name) != E8M0 or tuple(self.shape(scale_name)) != tuple(grid):
      raise errors.CheckpointError(f"{where} is {self.dtype(scale_name)} {list(self.shape(scale_name))}; FP4 values "
                                   f"of {name} need float8_e8m0fnu scales {list(grid)}, one per {FP4_GROUP} values")
    codes = self._raw(scale_name)
    if (codes == microscaling.E8M0_NAN).any():
      raise errors.CheckpointError(f"{where} holds NaN e8m0 scale(s) (byte 0xff); accepted: bytes 0x00..0xfe")
    return codes

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of `name` as float32, reading only their bytes (a quantized weight: whole, then cut)."""
    file, entry = self.table[name]
    if entry["dtype"] not in FLOATS or not entry["shape"]:
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


def check_power_of_two(scale: np.ndarray, where: str) -> None:
  """Refuses float32 scales that are not powers of two (`scale_fmt: ue8m0`)."""
  mantissa = np.frexp(np.asarray(scale, np.float32))[0]
  bad = mantissa != 0.5
  if bad.any():
    index = np.unravel_index(int(np.argmax(bad)), scale.shape)
    raise errors.CheckpointError(
        f"{where} holds {int(bad.sum())} scale(s) that are not powers of two, e.g. {float(scale[index])!r} at "
        f"{list(map(int, index))}, but config.json says scale_fmt ue8m0; accepted: powers of two (or no scale_fmt)")


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
  """The `weight_scale_inv` grid of an (out, in) weight: one per block, rounded up at the edges."""
  return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
