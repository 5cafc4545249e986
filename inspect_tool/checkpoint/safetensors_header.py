"""Lists safetensors tensors (name, shape, dtype) from file headers alone, never reading tensor data.

A safetensors file starts with an 8-byte little-endian header length and that many bytes of JSON mapping
each tensor name to `{"dtype", "shape", "data_offsets"}`. Accepted inputs: one file, a directory of
`*.safetensors` files, or a sharded set described by `*.safetensors.index.json` (file or its directory).
Keys are the Hugging Face names split on '.'.
"""

from __future__ import annotations

import glob
import json
import os
import struct

from inspect_tool import errors
from inspect_tool import tree

# safetensors dtype tags -> numpy / ml_dtypes names.
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn", "F4": "float4_e2m1fn",
}
_MAX_HEADER = 100 * 1024 * 1024
INDEX_SUFFIX = ".safetensors.index.json"


def _bad(path: str, why: str) -> errors.CheckpointError:
  return errors.CheckpointError(f"{path}: not a valid safetensors file ({why})")


def read_header(path: str) -> dict[str, dict]:
  """The tensor entries of one file's header (`__metadata__` left out), validated against the file size."""
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      prefix = f.read(8)
      if len(prefix) < 8:
        raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
      (length,) = struct.unpack("<Q", prefix)
      if length > min(_MAX_HEADER, size - 8):
        raise _bad(path, f"header length {length} exceeds the file's {size - 8} remaining bytes")
      raw = f.read(length)
  except OSError as e:
    raise errors.CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
  try:
    header = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise _bad(path, f"header is not valid JSON: {str(e).splitlines()[0]}") from None
  if not isinstance(header, dict):
    raise _bad(path, "header is not a JSON object")
  data_size = size - 8 - length
  entries = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
      shape = [int(d) for d in shape]
      begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError):
      raise _bad(path, f"entry {name!r} lacks dtype/shape/data_offsets") from None
    if not 0 <= begin <= end <= data_size:
      raise _bad(path, f"tensor {name!r} data_offsets [{begin}, {end}] exceed the {data_size} data bytes "
                       "(truncated file?)")
    entries[name] = {"dtype": str(dtype), "shape": shape}
  return entries


def dtype_name(tag: str) -> str:
  """`F8_E4M3` -> `float8_e4m3fn`; an unknown tag is returned lower-cased."""
  return DTYPES.get(tag, tag.lower())


def _leaf(name: str, entry: dict) -> tree.Leaf:
  return tree.Leaf(tuple(name.split(".")), tuple(entry["shape"]), dtype_name(entry["dtype"]))


def _read_index(index_path: str) -> list[tree.Leaf]:
  try:
    with open(index_path, "rb") as f:
      doc = json.load(f)
  except OSError as e:
    raise errors.CheckpointError(f"cannot read {index_path}: {e.strerror or e}") from None
  except (ValueError, UnicodeDecodeError) as e:
    raise errors.CheckpointError(f"{index_path}: not valid JSON ({str(e).splitlines()[0]})") from None
  weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
  if not isinstance(weight_map, dict) or not weight_map:
    raise errors.CheckpointError(f"{index_path}: no 'weight_map' object naming tensors and their shard files")
  directory = os.path.dirname(index_path)
  shards: dict[str, list[str]] = {}
  for name, shard in weight_map.items():
    shards.setdefault(str(shard), []).append(name)
  missing = sorted(s for s in shards if not os.path.isfile(os.path.join(directory, s)))
  if missing:
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise errors.CheckpointError(f"{index_path}: {len(missing)} shard file(s) missing: {shown}")
  leaves = []
  for shard, names in sorted(shards.items()):
    shard_path = os.path.join(directory, shard)
    header = read_header(shard_path)
    absent = [n for n in names if n not in header]
    if absent:
      raise errors.CheckpointError(
          f"{shard_path}: lacks {len(absent)} tensor(s) the index assigns to it, e.g. {absent[0]!r}")
    leaves.extend(_leaf(n, header[n]) for n in names)
  return leaves


def _read_files(files: list[str]) -> list[tree.Leaf]:
  seen: dict[str, str] = {}
  leaves = []
  for path in files:
    for name, entry in read_header(path).items():
      if name in seen:
        raise errors.CheckpointError(f"tensor {name!r} is stored twice: in {seen[name]} and {path}")
      seen[name] = path
      leaves.append(_leaf(name, entry))
  return leaves


def read_leaves(path: str) -> list[tree.Leaf]:
  """Every tensor of a safetensors file, directory or index, sorted by key.

  Raises:
    errors.CheckpointError: missing path or shard, no safetensors files, or a corrupt header.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise errors.CheckpointError(f"safetensors path does not exist: {path}")
  if os.path.isfile(path):
    leaves = _read_index(path) if path.endswith(".json") else _read_files([path])
    return tree.sort_leaves(leaves)
  indexes = sorted(glob.glob(os.path.join(glob.escape(path), "*" + INDEX_SUFFIX)))
  if len(indexes) > 1:
    names = ", ".join(os.path.basename(i) for i in indexes)
    raise errors.CheckpointError(f"{path}: several safetensors indexes ({names}); pass one of them")
  if indexes:
    return tree.sort_leaves(_read_index(indexes[0]))
  files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
  if not files:
    raise errors.CheckpointError(f"no *.safetensors files or {INDEX_SUFFIX} in {path}")
  return tree.sort_leaves(_read_files(files))
